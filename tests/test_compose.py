"""compose.yaml: valid against the compose spec, wired by health, every container hardened, and its
three commands and environments, taken from the file with the settings interpolated as compose does,
serve as local processes that require the API key and the gRPC token."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from pagedserve.entrypoints.cli import build_parser
from pagedserve.v1 import engine_pb2, engine_pb2_grpc

from tests.serving import free_port, wait_http

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("executor", "scheduler", "gateway")
# The engines behind the same gateway that COMPOSE_PROFILES turns on, by profile.
PROFILES = {"embed": ("embed-executor", "embed-scheduler"), "rerank": ("rerank-executor", "rerank-scheduler")}


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_file_matches_the_compose_spec():
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    run = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "compose.yaml")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_compose_wires_three_services_by_health():
    services = compose()["services"]
    assert set(services) == {*SERVICES, *(name for names in PROFILES.values() for name in names)}
    assert not any("profiles" in services[name] for name in SERVICES)
    gpu = services["executor"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert services["scheduler"]["depends_on"]["executor"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    for name, svc in services.items():
        assert svc["healthcheck"]["test"][:3] == ["CMD", "pagedserve", "probe"], name
        assert any(v.endswith(":/models:ro") for v in svc["volumes"]), name
        assert svc["entrypoint"] == ["pagedserve"], name
    assert services["gateway"]["ports"] == ["${BIND_ADDRESS:-127.0.0.1}:${PORT:-8000}:8000"]
    assert services["gateway"]["environment"]["PAGEDSERVE_API_KEY"] == "${PAGEDSERVE_API_KEY:-}"


def test_every_container_is_hardened_and_only_the_gateway_reaches_the_engine():
    spec = compose()
    for name, svc in spec["services"].items():
        assert svc["read_only"] is True, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        user, _, group = svc["user"].partition(":")
        assert int(user) != 0 and int(group) != 0, name
        assert svc["tmpfs"] == ["/tmp"], name
        assert svc["environment"]["PAGEDSERVE_GRPC_TOKEN"] == "${PAGEDSERVE_GRPC_TOKEN:-}", name
    services = spec["services"]
    assert spec["networks"]["engine"] == {"internal": True}
    assert services["executor"]["networks"] == services["scheduler"]["networks"] == ["engine"]
    assert "engine" in services["gateway"]["networks"]
    assert not any("ports" in services[name] for name in ("executor", "scheduler"))


def test_the_embed_and_rerank_profiles_add_engines_that_the_gateway_routes_to():
    services = compose()["services"]
    for profile, (executor, scheduler) in PROFILES.items():
        assert services[executor]["profiles"] == services[scheduler]["profiles"] == [profile]
        assert services[executor]["deploy"] == services["executor"]["deploy"]
        # After the chat model's executor, so that each measures the GPU's memory alone.
        assert services[executor]["depends_on"]["executor"]["condition"] == "service_healthy"
        assert services[scheduler]["depends_on"][executor]["condition"] == "service_healthy"
        assert services["gateway"]["depends_on"][scheduler] == {"condition": "service_healthy", "required": False}
        assert services[executor]["networks"] == services[scheduler]["networks"] == ["engine"]
    settings = dict(MODEL="/models/chat", EMBED_MODEL="/models/bge-m3", EMBED_SERVED_MODEL_NAME="bge-m3,embed",
                    RERANK_MODEL="/models/bge-reranker")
    gateway = build_parser().parse_args(shlex.split(interpolate(services["gateway"]["command"], settings)))
    assert [(s.model, s.options) for s in gateway.also_serve] == [
        ("/models/bge-m3", {"scheduler-address": "embed-scheduler:50051", "served-model-name": "bge-m3,embed"}),
        ("/models/bge-reranker", {"scheduler-address": "rerank-scheduler:50051"})]
    assert build_parser().parse_args(shlex.split(interpolate(services["gateway"]["command"], {}))).also_serve == []
    for name in ("embed-executor", "embed-scheduler"):
        args = build_parser().parse_args(shlex.split(interpolate(services[name]["command"], settings)))
        assert args.model == "/models/bge-m3", name
    executor = build_parser().parse_args(shlex.split(interpolate(services["rerank-executor"]["command"], settings)))
    assert executor.gpu_memory_utilization == 0.04


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR:+alternative}, innermost first."""
    pattern = re.compile(r"\$\{(\w+)(?::([-+])([^${}]*))?\}")

    def value(m: re.Match) -> str:
        name, op, word = m.group(1), m.group(2), m.group(3) or ""
        current = env.get(name, "")
        if op == "+":
            return word if current else ""
        return current or (word if op == "-" else "")

    while (expanded := pattern.sub(value, text)) != text:
        text = expanded
    return text


def test_the_three_commands_serve_locally_with_a_key_and_token_from_the_environment(tmp_path):
    services = compose()["services"]
    executor, scheduler, port = free_port(), free_port(), free_port()
    # The compose network's names and the container port, as this machine's loopback; the batch
    # volume's path, as a folder of this test's.
    network = {"0.0.0.0:50052": f"127.0.0.1:{executor}", "executor:50052": f"127.0.0.1:{executor}",
               "0.0.0.0:50051": f"127.0.0.1:{scheduler}", "scheduler:50051": f"127.0.0.1:{scheduler}",
               "0.0.0.0": "127.0.0.1", "8000": str(port), "/var/lib/pagedserve/batches": str(tmp_path)}
    settings = dict(PAGEDSERVE_API_KEY="sk-compose", PAGEDSERVE_GRPC_TOKEN="compose-token",
                    SERVED_MODEL_NAME="composed alias", ENGINE_ARGS="--max-model-len 512 --max-num-seqs 4",
                    GATEWAY_ARGS="--enable-log-requests")
    # A container sees its service's `environment`, not the settings.
    host = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    processes = []
    try:
        for name in SERVICES:
            argv = [network.get(a, a) for a in shlex.split(interpolate(services[name]["command"], settings))]
            env = host | {k: interpolate(v, settings) for k, v in services[name]["environment"].items()}
            processes.append(subprocess.Popen([sys.executable, "-m", "pagedserve", *argv], env=env))
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", processes[-1], timeout=180)
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            urllib.request.urlopen(f"{url}/v1/models", timeout=10)
        assert unauthorized.value.code == 401
        request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": "Bearer sk-compose"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            card = json.loads(reply.read())["data"][0]
        assert (card["id"], card["max_model_len"]) == ("composed", 512)
        with grpc.insecure_channel(f"127.0.0.1:{scheduler}") as channel, pytest.raises(grpc.RpcError) as refused:
            engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            process.wait(timeout=20)
