"""The step loop: plans out at once, results applied in plan order, idle waits, sync driving."""
import asyncio

import pytest

from pagedserve.common.plan import StepPlan, StepResult
from pagedserve.executor_svc.null_worker import TOKEN, NullWorker, null_executor_info
from pagedserve.scheduler_svc.request import RequestDelta
from pagedserve.scheduler_svc.step_loop import RunnerTransport, StepLoop
from tests.scheduler_svc.helpers import add, make_scheduler


class Recorder:
    """An in-process transport that logs each launch and collect by step id."""

    def __init__(self) -> None:
        runner = NullWorker(null_executor_info(num_blocks=64, block_size=4, max_model_len=256))
        self.transport = RunnerTransport(runner)
        self.events: list[tuple[str, int]] = []

    async def launch(self, plan: StepPlan) -> None:
        self.events.append(("launch", plan.step_id))
        await self.transport.launch(plan)

    async def collect(self) -> StepResult:
        result = await self.transport.collect()
        self.events.append(("collect", result.step_id))
        return result

    def most_in_flight(self) -> int:
        in_flight = most = 0
        for event, _ in self.events:
            in_flight += 1 if event == "launch" else -1
            most = max(most, in_flight)
        return most


def collect_outputs(into: dict[int, list[int]]):
    def deliver(outputs: list[RequestDelta]) -> None:
        for out in outputs:
            into.setdefault(out.seq_id, []).extend(out.new_token_ids)
    return deliver


@pytest.mark.parametrize("async_scheduling, most_in_flight", [(True, 2), (False, 1)])
def test_plans_in_flight_and_results_in_plan_order(async_scheduling, most_in_flight):
    s = make_scheduler()
    for seq_id in (1, 2, 3):
        add(s, seq_id, 5, first_token=10 * seq_id, max_tokens=4)
    recorder, tokens = Recorder(), {}
    StepLoop(s, async_scheduling).run_sync(recorder, collect_outputs(tokens))
    assert tokens == {1: [TOKEN] * 4, 2: [TOKEN] * 4, 3: [TOKEN] * 4}
    assert recorder.most_in_flight() == most_in_flight
    launched = [step for event, step in recorder.events if event == "launch"]
    assert [step for event, step in recorder.events if event == "collect"] == launched
    assert not s.has_work()


async def test_run_waits_for_work_when_idle_and_goes_on():
    s = make_scheduler()
    add(s, 1, 3, max_tokens=2)
    loop, tokens, waits = StepLoop(s), {}, []

    async def wait_for_work() -> None:
        waits.append(dict(tokens))
        if len(waits) == 2:
            raise asyncio.CancelledError
        add(s, 2, 3, first_token=50, max_tokens=3)

    with pytest.raises(asyncio.CancelledError):
        await loop.run(Recorder(), collect_outputs(tokens), wait_for_work)
    assert waits == [{1: [TOKEN] * 2}, {1: [TOKEN] * 2, 2: [TOKEN] * 3}]
    assert not loop.in_flight


def test_run_sync_refuses_a_transport_that_suspends():
    class Suspending(Recorder):
        async def launch(self, plan: StepPlan) -> None:
            await asyncio.sleep(0)

    s = make_scheduler()
    add(s, 1, 3)
    with pytest.raises(RuntimeError, match="await StepLoop.run"):
        StepLoop(s).run_sync(Suspending(), collect_outputs({}))
