"""Tensor parallelism's processes, as rank 0 (the executor server, or the offline LLM) sees them:
it starts ranks 1..N-1 as child processes (executor_svc/tp_worker.py), each with a Worker of
its own, and has them repeat its worker calls in its order, so that every rank holds the same
requests and runs the same collectives. The calls travel over the gloo group, a list per
launch or reset: a collect runs no collective, so it waits for the next message."""
import dataclasses
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedserve.common.config import EngineConfig
from pagedserve.common.log import get_logger, settings
from pagedserve.executor_svc.parallel import TensorParallel, free_port, init_group

log = get_logger(__name__)

WORKER_MODULE = "pagedserve.executor_svc.tp_worker"
STOP_GRACE_S = 5.0


@dataclass(slots=True)
class Workers:
    """Rank 0's handle on the other ranks: their processes, and the calls not yet sent."""
    processes: list[subprocess.Popen]
    tp: TensorParallel | None = None
    pending: list[tuple[str, tuple]] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def call(self, method: str, *args: object) -> None:
        """Has every other rank call `method(*args)` on its Worker, after the deferred calls."""
        self.pending.append((method, args))
        self.tp.send(self.pending)
        self.pending = []

    def defer(self, method: str, *args: object) -> None:
        """Queues a call that runs no collective, to go with the next `call`."""
        self.pending.append((method, args))

    def watch(self, rank: int, process: subprocess.Popen) -> None:
        """Ends this process when a rank dies: every collective would wait for it forever. Waits
        a moment first, for rank 0 to fail at start-up the way that rank did and say why."""
        code = process.wait()
        if self.stopped.wait(STOP_GRACE_S):
            return
        log.error("tp_worker_exited", rank=rank, code=code,
                  message=f"tensor-parallel rank {rank} stopped; stopping rank 0 too")
        os._exit(1)

    def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_workers(config: EngineConfig, offline: bool, device: torch.device) -> Workers:
    """Starts ranks 1..N-1 and joins them as rank 0; returns once the group is up."""
    size, port = config.tensor_parallel_size, free_port()
    spec = json.dumps({"config": dataclasses.asdict(config), "offline": offline,
                       "log": settings, "parent": os.getpid()})
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size)}
    processes = [subprocess.Popen([sys.executable, "-m", WORKER_MODULE, spec],
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(1, size)]
    workers = Workers(processes)
    for rank, process in enumerate(processes, 1):
        threading.Thread(target=workers.watch, args=(rank, process), daemon=True,
                         name=f"tp-rank{rank}-watch").start()
    log.info("tp_workers_started", tensor_parallel_size=size, pids=[p.pid for p in processes])
    try:
        workers.tp = init_group(0, size, device, f"tcp://127.0.0.1:{port}")
    except BaseException:
        workers.stop()
        raise
    return workers
