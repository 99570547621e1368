"""`pagedserve serve`: starts executor, scheduler and gateway as child processes and supervises them.
With --data-parallel-size N, N executor + scheduler pairs (an engine each, on its own GPU) behind one
gateway; with --also-serve, an engine of each other model too, sharing engine 0's GPUs.

If any child exits, all stop, except a data-parallel engine's executor: it is started again, its
scheduler reattaches, and meanwhile the other engines serve. SIGINT/SIGTERM stop the gateway first (it refuses new requests and
gives running ones --shutdown-timeout to finish), then the scheduler, then the executor. Children
die with the launcher even if it is killed (PDEATHSIG).

The executors start before the launcher has checked the model, and the gateway before the
schedulers serve, each held after its imports at a gate (a pipe; common/process.py's
pass_start_gate) that the launcher opens when it may go on: on a 2-core machine their imports then
overlap other work, 12.6 -> 11.4 s from `serve` to /health (BENCHMARKS.md)."""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.common import service
from pagedserve.common.log import get_logger
from pagedserve.common.process import (PARENT_PID_ENV, START_GATE_ENV, environment_without_secrets,
                                       process_alive)
from pagedserve.entrypoints.preflight import connect_host
from pagedserve.gateway import uds

log = get_logger(__name__)
STOP_TIMEOUT_S = 5.0
SOCKET_DIR_PREFIX = "pagedserve-"
# In a launcher's socket folder, its pid: a later launcher removes the folders of launchers that are
# gone. In a file, not the folder's name, which a socket's path (107 bytes at most) has no room for.
OWNER_FILE = "launcher.pid"


@dataclass(slots=True)
class AlsoEngine:
    """An --also-serve model: one engine (executor and scheduler) on the GPUs of the main engine 0."""
    model: str
    # Its children's own flags, by child ("executor", "scheduler").
    argv: dict[str, list[str]]
    # What the gateway's --also-serve says of it besides its scheduler's address.
    gateway: dict[str, str]

    def gateway_spec(self, scheduler_address: str) -> str:
        options = {"scheduler-address": scheduler_address, **self.gateway}
        return ",".join([self.model, *(f"{key}={value}" for key, value in options.items())])


def new_socket_dir() -> str:
    """A new folder for a launcher's sockets, made after removing those of launchers that are gone:
    one killed outright (SIGKILL) leaves its folder behind."""
    for owner in Path(tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}*/{OWNER_FILE}"):
        with contextlib.suppress(OSError, ValueError):
            if not process_alive(int(owner.read_text())):
                shutil.rmtree(owner.parent, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
    (Path(path) / OWNER_FILE).write_text(str(os.getpid()))
    return path


@dataclass(slots=True)
class Child:
    name: str
    process: subprocess.Popen
    # Starts it again when it exits, for a child that is restarted rather than stopping all.
    restart: Callable[[], subprocess.Popen] | None = None
    # The write end of the pipe that a gated child waits on once it has imported its modules.
    gate: int | None = None


class Launcher:
    def __init__(self, shutdown_timeout: float = 0.0) -> None:
        # The gateway's drain, which its stop timeout must not cut short.
        self.shutdown_timeout = shutdown_timeout
        self.children: list[Child] = []
        self.stopping = False
        self.socket_dir = new_socket_dir()

    def socket(self, name: str) -> str:
        return f"unix://{self.socket_dir}/{name}.sock"

    def spawn(self, name: str, argv: list[str], pass_fds: tuple[int, ...] = (),
              env: dict[str, str] | None = None, restart: bool = False, gated: bool = False) -> Child:
        """Starts `pagedserve <argv>`, with `env` added to this process's environment less its
        secrets (the gateway gets the API key in its own `env`); with `restart`, supervise() starts
        it again whenever it exits (ungated); with `gated`, the child waits after its imports until
        open_gate() lets it go on, and exits quietly if stop() closes its gate instead."""
        command = [sys.executable, "-m", "pagedserve", *argv]
        environment = environment_without_secrets() | (env or {}) | {PARENT_PID_ENV: str(os.getpid())}

        def start(gate: tuple[int, ...] = ()) -> subprocess.Popen:
            # No preexec_fn: the child asks to die with this process itself (die_with_launcher).
            return subprocess.Popen(command, start_new_session=True, pass_fds=pass_fds + gate,
                                    env=environment | {START_GATE_ENV: str(fd) for fd in gate})
        if not gated:
            child = Child(name, start(), start if restart else None)
        else:
            read, write = os.pipe()
            child = Child(name, start((read,)), start if restart else None, write)
            os.close(read)
        self.children.append(child)
        return child

    def open_gate(self, child: Child) -> None:
        """Lets a gated child go on past its imports."""
        if child.gate is not None:
            # A child that died meanwhile is reported by wait_ready.
            with contextlib.suppress(BrokenPipeError):
                os.write(child.gate, b"1")
            self.close_gate(child)

    def close_gate(self, child: Child) -> None:
        if child.gate is not None:
            os.close(child.gate)
            child.gate = None

    def wait_ready(self, child: Child, ready: Callable[[], bool], timeout: float) -> None:
        """Waits until `ready()` holds; exits if the child dies or the timeout passes first."""
        name, process = child.name, child.process
        deadline = time.monotonic() + timeout
        while not self.stopping:
            code = process.poll()
            if code is not None and code > 0:
                # The child said why, in one line; another would only repeat it.
                raise SystemExit(code)
            if code is not None:
                raise SystemExit(f"pagedserve: error: the {name} was killed by signal {-code} "
                                 "during start-up")
            if ready():
                log.info("service_ready", service=name, pid=process.pid)
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"pagedserve: the {name} did not become ready in {timeout:.0f} s")
            time.sleep(0.2)

    def supervise(self) -> int:
        """Blocks until a signal (returns 0) or until a child exits on its own (returns 1)."""
        while not self.stopping:
            for child in self.children:
                if child.process.poll() is None:
                    continue
                if child.restart is None:
                    log.error("service_exited", service=child.name, code=child.process.returncode,
                              message=f"the {child.name} stopped; stopping pagedserve")
                    return 1
                log.warning("service_restarting", service=child.name, code=child.process.returncode,
                            message=f"the {child.name} stopped; starting it again")
                child.process = child.restart()
            time.sleep(0.2)
        return 0

    def request_stop(self, signum: int, frame) -> None:
        self.stopping = True

    def stop(self) -> None:
        """Stops the gateway first (it drains), then the other children in reverse start order
        (schedulers before their executors), then removes their sockets' folder."""
        for child in sorted(reversed(self.children), key=lambda child: child.name != "gateway"):
            self.close_gate(child)
            if child.process.poll() is None:
                child.process.terminate()
                drain = self.shutdown_timeout if child.name == "gateway" else 0.0
                try:
                    child.process.wait(drain + STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    log.warning("service_killed", service=child.name)
                    child.process.kill()
                    child.process.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def grpc_ready(address: str) -> Callable[[], bool]:
    def probe() -> bool:
        with service.sync_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    return probe


def http_ready(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False
    return probe


def gateway_ready(host: str, port: int, https: bool) -> Callable[[], bool]:
    """/health answering 200 over HTTP. Over HTTPS, a connection accepted: the gateway's socket is
    bound before it starts and listens once it serves, and a TLS probe could not pass a gateway
    that requires client certificates."""
    if not https:
        return http_ready(f"http://{host}:{port}/health")

    def probe() -> bool:
        try:
            socket.create_connection((host.strip("[]"), port), timeout=1).close()
        except OSError:
            return False
        return True
    return probe


def engine_devices(data_parallel_size: int, gpus_per_engine: int, visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each engine's executor: consecutive groups of `gpus_per_engine` of the
    GPUs `visible` lists (this process's CUDA_VISIBLE_DEVICES), else of GPUs 0, 1, ..."""
    total = data_parallel_size * gpus_per_engine
    gpus = visible.split(",") if visible else [str(i) for i in range(total)]
    if len(gpus) < total:
        raise ValueError(f"--data-parallel-size {data_parallel_size} needs {total} GPUs but "
                         f"CUDA_VISIBLE_DEVICES={visible} lists {len(gpus)}; list more or lower the size")
    return [",".join(gpus[i * gpus_per_engine:(i + 1) * gpus_per_engine]) for i in range(data_parallel_size)]


def start_also(launcher: Launcher, index: int, engine: AlsoEngine, scheduler: str, env: dict[str, str],
               timeout: float) -> Child:
    """Starts an --also-serve engine's executor and its scheduler (at `scheduler`), and waits for
    the executor; returns the scheduler. Called once the executors before it are up: an executor
    sizes its KV cache from the memory that the GPU's other engines leave, which must hold still
    while it measures."""
    name = f"{index} ({engine.model})"
    executor = launcher.socket(f"also{index}-executor")
    started = launcher.spawn(f"executor {name}", ["executor", engine.model, "--address", executor,
                                                  *engine.argv["executor"]], env=env)
    child = launcher.spawn(f"scheduler {name}", ["scheduler", engine.model, "--address", scheduler,
                                                 "--executor-address", executor, *engine.argv["scheduler"]])
    launcher.wait_ready(started, grpc_ready(executor), timeout)
    return child


@dataclass(slots=True)
class Engine:
    """An engine's executor, started gated by start_executors, and where it listens."""
    executor: Child
    address: str
    # Its environment beyond the launcher's: the GPUs it may see.
    env: dict[str, str]
    # After its children's names: "" for one engine, else " <index>".
    suffix: str


def start_executors(launcher: Launcher, model: str, argv: list[str], data_parallel_size: int = 1,
                    tensor_parallel_size: int = 1) -> list[Engine]:
    """Starts the executor of each of `data_parallel_size` engines (each on `tensor_parallel_size`
    GPUs) behind its gate, which serve() opens: its imports, about 2 s on a 2-core machine, overlap
    the launcher's own checks of the model rather than follow them."""
    indices = range(data_parallel_size)
    suffixes = [""] if data_parallel_size == 1 else [f" {i}" for i in indices]
    # One engine keeps the GPUs it is given, as before data parallelism.
    envs = ([{}] if data_parallel_size == 1 else
            [{"CUDA_VISIBLE_DEVICES": d} for d in engine_devices(data_parallel_size, tensor_parallel_size,
                                                                 os.environ.get("CUDA_VISIBLE_DEVICES"))])
    addresses = [launcher.socket(f"executor{i}") for i in indices]
    return [Engine(launcher.spawn(f"executor{suffixes[i]}", ["executor", model, "--address", addresses[i], *argv],
                                  env=envs[i], restart=data_parallel_size > 1, gated=True),
                   addresses[i], envs[i], suffixes[i]) for i in indices]


def serve(launcher: Launcher, engines: list[Engine], model: str, argv: dict[str, list[str]],
          listener: socket.socket, scheduler_addresses: list[str] | None, startup_timeout: float,
          api_key: str | None = None, also: Sequence[AlsoEngine] = (), https: bool = False) -> int:
    """Runs the whole stack on this machine until a signal, then stops `launcher`; returns the exit
    code. `engines` (start_executors) go on past their gates and a scheduler starts beside each, at
    `scheduler_addresses` when given; `argv` holds the scheduler's and the gateway's own flags. The
    gateway serves on `listener`, bound already, so that only it can answer on that port, and alone
    receives `api_key`, in its environment. Each of `also` (--also-serve) starts after them, one at
    a time, on engine 0's GPUs. With `https` the gateway serves HTTPS (its --ssl-* flags are in its
    argv)."""
    gateway_address, ready, url = gateway_listener(listener, https)
    socket_file = listener.getsockname() if listener.family == socket.AF_UNIX else None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, launcher.request_stop)
    scheduler_addresses = scheduler_addresses or [launcher.socket(f"scheduler{i}") for i in range(len(engines))]
    also_addresses = [launcher.socket(f"also{i + 1}-scheduler") for i in range(len(also))]
    routes = [f"--also-serve={extra.gateway_spec(address)}" for extra, address in zip(also, also_addresses)]
    try:
        # The gateway imports its modules and loads the tokenizer while the engines start; its gate
        # opens once every scheduler serves, so it listens with all of them in rotation.
        gateway = launcher.spawn("gateway", ["gateway", model, *gateway_address, "--listen-fd", str(listener.fileno()),
                                             "--scheduler-address", ",".join(scheduler_addresses), *routes,
                                             *argv["gateway"]], pass_fds=(listener.fileno(),),
                                 env={"PAGEDSERVE_API_KEY": api_key} if api_key else None, gated=True)
        for engine in engines:
            launcher.open_gate(engine.executor)
        # A scheduler waits for its executor itself: started now, its imports overlap the model's
        # load rather than follow it.
        schedulers = [launcher.spawn(f"scheduler{engine.suffix}", ["scheduler", model, "--address", address,
                                                                    "--executor-address", engine.address,
                                                                    *argv["scheduler"]])
                      for engine, address in zip(engines, scheduler_addresses)]
        for engine in engines:
            launcher.wait_ready(engine.executor, grpc_ready(engine.address), startup_timeout)
        schedulers += [start_also(launcher, i + 1, extra, address, engines[0].env, startup_timeout)
                       for i, (extra, address) in enumerate(zip(also, also_addresses))]
        for child, address in zip(schedulers, [*scheduler_addresses, *also_addresses]):
            launcher.wait_ready(child, grpc_ready(address), startup_timeout)
        launcher.open_gate(gateway)
        launcher.wait_ready(gateway, ready, startup_timeout)
        if not launcher.stopping:
            log.info("pagedserve_ready", url=url, data_parallel_size=len(engines),
                     also_serve=[extra.model for extra in also])
        return launcher.supervise()
    finally:
        listener.close()
        launcher.stop()
        if socket_file is not None:
            uds.remove(socket_file)


def gateway_listener(listener: socket.socket, https: bool) -> tuple[list[str], Callable[[], bool], str]:
    """The gateway's flags naming where `listener` is bound, its readiness probe, and where clients
    reach it: a URL, or unix:PATH for --uds."""
    if listener.family == socket.AF_UNIX:
        path = listener.getsockname()
        probe = (lambda: uds.answers(path)) if https else (lambda: uds.health_ok(path))
        return ["--uds", path], probe, f"unix:{path}"
    host, port = listener.getsockname()[:2]
    return (["--host", host, "--port", str(port)], gateway_ready(connect_host(host), port, https),
            f"{'https' if https else 'http'}://{connect_host(host)}:{port}/v1")
