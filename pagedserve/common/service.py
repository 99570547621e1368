"""Shared plumbing of the gRPC services: channel and server options, who may call them (a shared
token, optional mutual TLS), readiness, signals."""
import asyncio
import hmac
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A client started before its server (`serve`, compose, restarts) retries at most 0.1 s apart, not
# the default two minutes: at 1 s, a scheduler saw its executor serve 0.7-1.2 s late, on every
# start of `serve` (0.07-0.13 s at 0.1 s, with health polls at most POLL_MAX_S apart).
OPTIONS = [("grpc.max_reconnect_backoff_ms", 100),
           ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.so_reuseport", 0)]
POLL_MIN_S, POLL_MAX_S = 0.05, 0.1
# Beyond this many calls in flight a server answers RESOURCE_EXHAUSTED instead of queueing them
# without bound. A gateway holds one GenerateStream call per scheduler and a scheduler one Run
# call per executor; backend services calling Generate hold one per request, and more than
# this could not all be running anyway (max_num_seqs defaults to 256 or 1024).
MAX_CONCURRENT_RPCS = 1024

# The shared secret every Engine and Executor call must carry as `authorization: Bearer <token>`;
# unset or empty: no check (the services bind to loopback or to private Unix sockets by default).
TOKEN_ENV = "PAGEDSERVE_GRPC_TOKEN"
# Open without the token: the kubelet's gRPC probe sends no metadata, and the answer (SERVING or
# not) tells a caller nothing it could use.
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"


def token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """The metadata an Engine or Executor call carries: the token, when there is one. Passed per
    call rather than by a client interceptor, which added ~45 us to each round trip of a
    streaming call (measured on the Run stream's write and read)."""
    secret = token()
    return None if secret is None else (("authorization", f"Bearer {secret}"),)


@dataclass(frozen=True, slots=True)
class Tls:
    """This process's certificate chain and key, which it presents as a server and as a client, and
    the CA that the other side's certificate must chain to (None: the system's roots, and a server
    then asks clients for no certificate)."""
    cert: bytes
    key: bytes
    ca: bytes | None

    @classmethod
    def load(cls, cert: str, key: str, ca: str | None) -> "Tls":
        return cls(Path(cert).read_bytes(), Path(key).read_bytes(), None if ca is None else Path(ca).read_bytes())


# Set once at start-up from the --grpc-tls-* flags (use_tls); None: plain TCP or Unix sockets.
_tls: Tls | None = None


def use_tls(tls: Tls | None) -> None:
    """Makes every channel and server of this process use `tls` (None: none)."""
    global _tls
    _tls = tls


def _channel_credentials(tls: Tls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def channel(address: str) -> grpc.aio.Channel:
    if _tls is None:
        return grpc.aio.insecure_channel(address, options=OPTIONS)
    return grpc.aio.secure_channel(address, _channel_credentials(_tls), options=OPTIONS)


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel, for probes outside an event loop."""
    if _tls is None:
        return grpc.insecure_channel(address, options=OPTIONS)
    return grpc.secure_channel(address, _channel_credentials(_tls), options=OPTIONS)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses with UNAUTHENTICATED every call but health checks that lacks the token."""

    def __init__(self, secret: str) -> None:
        self._expected = f"Bearer {secret}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIX) or self._holds(details):
            return handler
        return _refusal(handler)

    def _holds(self, details: grpc.HandlerCallDetails) -> bool:
        sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        # Constant time: the comparison must not tell a caller how much of the token it has right.
        return hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected)


async def _refuse(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        f"this service needs the shared token: send the metadata 'authorization: Bearer "
                        f"<token>' with the token in {TOKEN_ENV}")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses; the request is left undecoded."""
    kind = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[handler.request_streaming, handler.response_streaming](_refuse)


@dataclass(slots=True)
class Service:
    server: grpc.aio.Server
    health: health_aio.HealthServicer

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=2)


async def start(name: str, address: str, add_servicer: Callable[[grpc.aio.Server], None],
                health: health_aio.HealthServicer | None = None) -> Service:
    """Serves one gRPC service plus the standard health service (`health`, a new one by default)
    at `address`, reporting SERVING; with the token set (PAGEDSERVE_GRPC_TOKEN) every call but
    health checks must carry it, and with use_tls every connection is TLS, mutual when a CA is given."""
    secret = token()
    server = grpc.aio.server(options=OPTIONS, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                             interceptors=None if secret is None else [TokenCheck(secret)])
    add_servicer(server)
    health = health or health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if not _listen(server, address):
        raise SystemExit(f"{name}: cannot listen on {address}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return Service(server, health)


def _listen(server: grpc.aio.Server, address: str) -> int:
    if _tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials([(_tls.key, _tls.cert)], root_certificates=_tls.ca,
                                              require_client_auth=_tls.ca is not None)
    return server.add_secure_port(address, credentials)


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
