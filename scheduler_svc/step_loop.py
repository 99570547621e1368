"""The step loop, the one copy of it that the engine, the offline LLM and the benchmarks run: plan
ahead, launch, collect the oldest result, apply it.

With async scheduling up to MAX_STEPS_IN_FLIGHT plans are out at once, so the executor launches
the next step while the device still runs the previous one; without it, one at a time. The loop is
a coroutine over a transport: the executor's gRPC stream suspends it, an in-process runner never
does, and `run_sync` then drives it without an event loop."""
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from pagedserve.common.plan import MAX_STEPS_IN_FLIGHT, StepPlan, StepResult
from pagedserve.scheduler_svc.request import RequestDelta
from pagedserve.scheduler_svc.scheduler import Scheduler

Deliver = Callable[[list[RequestDelta]], None]


class Transport(Protocol):
    """Carries plans to an executor and its results back, in plan order."""

    async def launch(self, plan: StepPlan) -> None: ...

    async def collect(self) -> StepResult:
        """The result of the oldest launched plan not yet collected."""
        ...


class Runner(Protocol):
    def launch(self, plan: StepPlan) -> object: ...

    def collect(self, launched: object) -> StepResult: ...


class RunnerTransport:
    """An in-process runner (Worker, NullWorker) as a transport; it never suspends."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.launched: deque = deque()

    async def launch(self, plan: StepPlan) -> None:
        self.launched.append(self.runner.launch(plan))

    async def collect(self) -> StepResult:
        return self.runner.collect(self.launched.popleft())


class StepLoop:
    """Steps a scheduler through a transport, handing each applied step's outputs to `deliver`."""

    def __init__(self, scheduler: Scheduler, async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.max_in_flight = MAX_STEPS_IN_FLIGHT if async_scheduling else 1
        # Plans launched whose results have not been applied, oldest first.
        self.in_flight: deque[StepPlan] = deque()

    async def run(self, transport: Transport, deliver: Deliver,
                  wait_for_work: Callable[[], Awaitable[None]] | None = None) -> None:
        """Steps until nothing is in flight and nothing can be planned; then awaits
        `wait_for_work` and goes on, or returns when there is none."""
        scheduler, in_flight = self.scheduler, self.in_flight
        while True:
            plan = self._plan_ahead()
            if plan is not None:
                await transport.launch(plan)
                in_flight.append(plan)
            elif in_flight:
                result = await transport.collect()
                deliver(scheduler.update(in_flight.popleft(), result))
            elif wait_for_work is None:
                return
            else:
                await wait_for_work()

    def _plan_ahead(self) -> StepPlan | None:
        """The next plan to send while fewer than max_in_flight are out, or None when nothing can be
        planned before a result (or, with none in flight, a request) arrives."""
        if len(self.in_flight) >= self.max_in_flight or not self.scheduler.has_work():
            return None
        plan = self.scheduler.schedule()
        return None if plan.is_empty() else plan

    def run_sync(self, transport: Transport, deliver: Deliver) -> None:
        """`run` to the end without an event loop, for a transport that never suspends: the
        coroutine then completes in one step, at no cost per step beyond the calls themselves."""
        steps = self.run(transport, deliver)
        try:
            steps.send(None)
        except StopIteration:
            return
        steps.close()
        raise RuntimeError("the transport suspended the step loop: await StepLoop.run instead")
