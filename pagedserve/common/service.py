"""Shared plumbing of the gRPC services: channel and server options, readiness, signals."""
import asyncio
import signal
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A client started before its server (compose, restarts) retries at most a second apart, not the
# default two minutes.
OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000),
           ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.so_reuseport", 0)]
POLL_MIN_S, POLL_MAX_S = 0.05, 1.0


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)


@dataclass(slots=True)
class Service:
    server: grpc.aio.Server
    health: health_aio.HealthServicer

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=2)


async def start(name: str, address: str, add_servicer: Callable[[grpc.aio.Server], None]) -> Service:
    """Serves one gRPC service plus the standard health service at `address`, reporting SERVING."""
    server = grpc.aio.server(options=OPTIONS)
    add_servicer(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if not server.add_insecure_port(address):
        raise SystemExit(f"{name}: cannot listen on {address}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return Service(server, health)


async def wait_serving(address: str, timeout: float, service: str = "") -> None:
    """Polls the standard health service at `address` until it reports SERVING, backing off from
    POLL_MIN_S to POLL_MAX_S between checks."""
    deadline = time.monotonic() + timeout
    delay = POLL_MIN_S
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
            await asyncio.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)


async def wait_for_signal() -> None:
    """Returns on the first SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
