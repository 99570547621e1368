"""Shared plumbing of the gRPC services: channel and server options, readiness, signals."""
import asyncio
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.so_reuseport", 0)]


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)


def server() -> grpc.aio.Server:
    return grpc.aio.server(options=OPTIONS)


async def wait_serving(address: str, timeout: float, service: str = "") -> None:
    """Polls the standard health service at `address` until it reports SERVING."""
    deadline = time.monotonic() + timeout
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy within {timeout:.0f} s")
            await asyncio.sleep(0.1)


async def wait_for_signal() -> None:
    """Returns on the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
