"""The executor's Run stream: plans launched as they arrive, results in plan order, errors fail it,
and a failed device turns the executor NOT_SERVING for good."""
import asyncio
import contextlib
import os
import signal
import threading
import time
from functools import partial

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pagedserve.executor_svc import server as executor_server
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.common import service
from pagedserve.common.config import EngineConfig
from pagedserve.executor_svc.null_worker import TOKEN, NullWorker, null_executor_info
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan, plan_to_proto, result_from_proto
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.v1 import executor_pb2_grpc


# Request 7's first step, and the step that decodes the token it samples (planned before its result).
PREFILL = plan_to_proto(StepPlan(1, new_requests=[NewRequest(7, [5, 6], 0, 2, [1], SamplingParams())]))
DECODE = plan_to_proto(StepPlan(2, continuing=[ContinuingRequest(7, 1, [])]))


@pytest.fixture
async def executor(tmp_path):
    address = f"unix://{tmp_path}/executor.sock"
    worker = NullWorker(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
    server = await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(worker)))
    async with service.channel(address) as channel:
        yield executor_pb2_grpc.ExecutorStub(channel)
    await server.stop()


async def test_two_plans_in_flight_come_back_in_order(executor):
    call = executor.Run()
    await call.write(PREFILL)
    await call.write(DECODE)
    first, second = result_from_proto(await call.read()), result_from_proto(await call.read())
    assert [(r.step_id, r.seq_ids, r.token_ids) for r in (first, second)] == [
        (1, [7], [TOKEN]), (2, [7], [TOKEN])]
    await call.done_writing()


class Recording(NullWorker):
    """Records its jobs in order. Each step lasts long enough for the next plan to arrive during
    it, and waiting on a step takes a while, as a thread hop can on a busy 2-core machine."""

    def __init__(self) -> None:
        super().__init__(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
        self.jobs: list[tuple[str, int]] = []

    def launch(self, plan: StepPlan):
        self.jobs.append(("launch", plan.step_id))
        time.sleep(0.05)
        return super().launch(plan)

    def wait(self, step) -> None:
        time.sleep(0.02)

    def collect(self, step):
        self.jobs.append(("collect", step.step_id))
        return step


@contextlib.asynccontextmanager
async def two_plans_sent(tmp_path, worker: NullWorker):
    """A Run stream to an executor of `worker`, PREFILL and DECODE written."""
    address = f"unix://{tmp_path}/executor.sock"
    server = await service.start("executor", address, partial(
        executor_pb2_grpc.add_ExecutorServicer_to_server, ExecutorService(worker)))
    async with service.channel(address) as channel:
        call = executor_pb2_grpc.ExecutorStub(channel).Run()
        await call.write(PREFILL)
        await call.write(DECODE)
        yield call
    await server.stop()


async def test_a_synchronous_step_is_collected_before_the_next_plan_runs(tmp_path):
    # On a CPU a launch runs the step: its result, collected at once, cannot fall behind the next
    # plan's step.
    worker = Recording()
    async with two_plans_sent(tmp_path, worker) as call:
        assert [result_from_proto(await call.read()).step_id for _ in range(2)] == [1, 2]
        await call.done_writing()
    assert worker.jobs == [("launch", 1), ("collect", 1), ("launch", 2), ("collect", 2)]


async def test_a_plan_the_executor_cannot_run_fails_the_stream(executor):
    call = executor.Run()
    await call.write(plan_to_proto(StepPlan(1, continuing=[ContinuingRequest(99, 1, [])])))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call.read()
    assert failed.value.code() == grpc.StatusCode.UNKNOWN


class BrokenDevice(NullWorker):
    """A worker whose device fails at the second step, as CUDA reports a device-side assert."""

    def launch(self, plan: StepPlan):
        if plan.step_id == 2:
            raise torch.AcceleratorError("CUDA error: device-side assert triggered\nCUDA kernel errors might be ...")
        return super().launch(plan)


async def test_a_failed_device_reports_not_serving_and_refuses_the_next_scheduler(tmp_path):
    address = f"unix://{tmp_path}/executor.sock"
    health = health_aio.HealthServicer()
    executor = ExecutorService(BrokenDevice(null_executor_info(num_blocks=16, block_size=4, max_model_len=64)),
                               health)
    server = await service.start("executor", address, partial(executor_pb2_grpc.add_ExecutorServicer_to_server,
                                                              executor), health)
    async with service.channel(address) as channel:
        stub, probe = executor_pb2_grpc.ExecutorStub(channel), health_pb2_grpc.HealthStub(channel)
        call = stub.Run()
        await call.write(PREFILL)
        assert result_from_proto(await call.read()).token_ids == [TOKEN]
        assert (await probe.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        await call.write(DECODE)
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        assert (await probe.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert executor.device_failed.is_set() and executor.broken == "CUDA error: device-side assert triggered"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Run().read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "device failed" in refused.value.details()
    await server.stop()


async def test_a_plan_error_leaves_the_executor_serving(executor, tmp_path):
    call = executor.Run()
    await call.write(plan_to_proto(StepPlan(1, continuing=[ContinuingRequest(99, 1, [])])))
    with pytest.raises(grpc.aio.AioRpcError):
        await call.read()
    second = executor.Run()
    await second.write(plan_to_proto(StepPlan(1, new_requests=[NewRequest(7, [5], 0, 1, [1], SamplingParams())])))
    assert result_from_proto(await second.read()).token_ids == [TOKEN]
    await second.done_writing()


class ThreadRecorder(NullWorker):
    """Records the thread that builds it and each that launches a step."""
    threads: list[int] = []

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
        self.threads.append(threading.get_ident())

    def launch(self, plan: StepPlan):
        self.threads.append(threading.get_ident())
        return super().launch(plan)


async def test_the_worker_is_built_on_the_thread_that_runs_its_steps(tmp_path, monkeypatch):
    # libgomp gives each thread that starts a parallel region an OpenMP team of its own, and with
    # two teams on two cores its barriers stop spinning: a CPU step then took 1.7x as long.
    monkeypatch.setattr(executor_server, "Worker", ThreadRecorder)
    monkeypatch.setattr(ThreadRecorder, "threads", [])
    address = f"unix://{tmp_path}/executor.sock"
    serving = asyncio.create_task(executor_server.serve(EngineConfig(), address))
    await service.wait_serving(address, timeout=30)
    async with service.channel(address) as channel:
        call = executor_pb2_grpc.ExecutorStub(channel).Run()
        for step_id in (1, 2):
            plan = StepPlan(step_id, new_requests=[NewRequest(step_id, [5, 6], 0, 2, [1], SamplingParams())])
            await call.write(plan_to_proto(plan))
            await call.read()
        await call.done_writing()
    os.kill(os.getpid(), signal.SIGTERM)
    await serving
    assert len(ThreadRecorder.threads) == 3 and len(set(ThreadRecorder.threads)) == 1
    assert ThreadRecorder.threads[0] != threading.get_ident()


class FailsFirst(Recording):
    """Fails its first step after the second plan has arrived, and records resets."""

    def launch(self, plan: StepPlan):
        if plan.step_id == 1:
            self.jobs.append(("launch", 1))
            time.sleep(0.2)
            raise ValueError("step 1 failed")
        return super().launch(plan)

    def reset(self) -> None:
        self.jobs.append(("reset", 0))


async def test_plans_queued_behind_a_failed_step_never_run(tmp_path):
    worker = FailsFirst()
    async with two_plans_sent(tmp_path, worker) as call:
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()
        for _ in range(100):
            if ("reset", 0) in worker.jobs:
                break
            await asyncio.sleep(0.01)
    assert worker.jobs == [("launch", 1), ("reset", 0)]
