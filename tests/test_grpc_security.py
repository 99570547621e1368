"""Who may call the gRPC services: the shared token (PAGEDSERVE_GRPC_TOKEN) on every call but health
checks, mutual TLS with --grpc-tls-*, and `serve` handing its children a token of its own."""
import os
from functools import partial

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.common import service
from pagedserve.entrypoints.cli import build_parser, grpc_tls_argv, share_grpc_token, use_grpc_tls
from pagedserve.executor_svc.null_worker import NullWorker, null_executor_info
from pagedserve.executor_svc.server import ExecutorService
from pagedserve.v1 import executor_pb2, executor_pb2_grpc

SECRET = "s3cret-token"


async def start_executor(address: str) -> service.Service:
    worker = NullWorker(null_executor_info(num_blocks=16, block_size=4, max_model_len=64))
    return await service.start("executor", address, partial(executor_pb2_grpc.add_ExecutorServicer_to_server,
                                                            ExecutorService(worker)))


async def describe(address: str, metadata=None) -> executor_pb2.ExecutorInfo:
    async with service.channel(address) as channel:
        return await executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=10,
                                                                       metadata=metadata)


async def health(address: str) -> int:
    async with service.channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status


async def test_a_call_without_the_token_is_unauthenticated_and_health_stays_open(tmp_path, monkeypatch):
    monkeypatch.setenv(service.TOKEN_ENV, SECRET)
    address = f"unix://{tmp_path}/executor.sock"
    server = await start_executor(address)
    try:
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", SECRET),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await describe(address, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert service.TOKEN_ENV in refused.value.details()
        async with service.channel(address) as channel:
            call = executor_pb2_grpc.ExecutorStub(channel).Run()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The kubelet's gRPC probe sends no metadata.
        assert await health(address) == health_pb2.HealthCheckResponse.SERVING
        assert (await describe(address, service.call_metadata())).block_size == 4
    finally:
        await server.stop()


async def test_without_a_token_set_nothing_is_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(service.TOKEN_ENV, raising=False)
    address = f"unix://{tmp_path}/executor.sock"
    server = await start_executor(address)
    try:
        assert service.call_metadata() is None
        assert (await describe(address)).block_size == 4
    finally:
        await server.stop()


@pytest.fixture
def restore_tls():
    yield
    service.use_tls(None)


async def test_mutual_tls_admits_only_certificates_of_the_ca(pki, restore_tls, unused_tcp_port):
    address = f"127.0.0.1:{unused_tcp_port}"
    use_grpc_tls(build_parser().parse_args(
        ["executor", f"--grpc-tls-cert={pki}/service.pem", f"--grpc-tls-key={pki}/service.key",
         f"--grpc-tls-ca={pki}/ca.pem"]))
    server = await start_executor(address)
    try:
        assert (await describe(address)).block_size == 4
        service.use_tls(service.Tls.load(f"{pki}/stranger.pem", f"{pki}/stranger.key", f"{pki}/ca.pem"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await describe(address)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        service.use_tls(None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await describe(address)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


def test_tls_flags_go_together_and_pass_on_to_children():
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="go together"):
        use_grpc_tls(parse(["scheduler", "--grpc-tls-cert=/c.pem"]))
    with pytest.raises(ValueError, match="go together"):
        use_grpc_tls(parse(["gateway", "--grpc-tls-ca=/ca.pem"]))
    args = parse(["serve", "--grpc-tls-cert=/c.pem", "--grpc-tls-key=/k.pem"])
    assert grpc_tls_argv(args) == ["--grpc-tls-cert=/c.pem", "--grpc-tls-key=/k.pem"]


def test_serve_gives_its_children_a_random_token_unless_one_is_set(monkeypatch):
    # Set through monkeypatch first, so that its undo removes what share_grpc_token sets.
    monkeypatch.setenv(service.TOKEN_ENV, "")
    share_grpc_token(None)
    made = os.environ[service.TOKEN_ENV]
    assert len(made) >= 32
    monkeypatch.delenv(service.TOKEN_ENV)
    share_grpc_token(None)
    assert os.environ[service.TOKEN_ENV] != made
    monkeypatch.setenv(service.TOKEN_ENV, SECRET)
    share_grpc_token(["127.0.0.1:50051"])
    assert os.environ[service.TOKEN_ENV] == SECRET
