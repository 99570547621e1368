"""Step timing on the device that runs the steps: CUDA events on a GPU, so that the time a step
took and the gap the GPU sat idle before it are measured where the work happens, not on a host
that runs ahead of it; the host clock on the CPU, where every step runs synchronously."""
import time

import torch


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | int:
        """A point in the device's stream of work; on a GPU it is passed when the work before it is."""
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark: torch.cuda.Event | int) -> None:
        """Blocks until the device has passed `mark` (without holding the GIL)."""
        if self.cuda:
            mark.synchronize()

    def elapsed_ns(self, start: torch.cuda.Event | int, end: torch.cuda.Event | int) -> int:
        """Device time between two passed marks."""
        if not self.cuda:
            return end - start
        return int(start.elapsed_time(end) * 1e6)
