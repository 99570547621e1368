"""The commands of vLLM's deployment guides with `pagedserve` in place of `vllm`, against the
default model; then the bad starts a new user makes, each of which must fail fast, in one line."""
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.pki import make_pki
from tests.real_model import smollm2_path
from tests.serving import free_port, wait_http, wait_uds

GUIDE_MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def default_model() -> Path:
    return smollm2_path()


def start(command: list[str], tmp: Path, port: int, context: ssl.SSLContext | None = None, **env: str) -> dict:
    """Starts `command`; returns once /health answers, over HTTPS with `context`."""
    stderr = tmp / f"stderr-{port}.log"
    environment = dict(os.environ, TMPDIR=str(tmp), **env)
    with stderr.open("w") as err:
        process = subprocess.Popen(command, env=environment, stderr=err)
    scheme = "http" if context is None else "https"
    wait_http(f"{scheme}://127.0.0.1:{port}/health", process, timeout=180, context=context)
    return dict(process=process, stderr=stderr, tmp=tmp, base_url=f"{scheme}://127.0.0.1:{port}/v1",
                port=port, children=psutil.Process(process.pid).children(recursive=True))


def stop(server: dict) -> None:
    process = server["process"]
    process.terminate()
    process.wait(timeout=20)
    gone, alive = psutil.wait_procs(server["children"], timeout=10)
    assert not alive, f"left behind: {alive}"
    assert not list(server["tmp"].glob("pagedserve-*")), "the launcher left its socket folder"


@pytest.fixture(scope="module")
def guide_server(default_model, tmp_path_factory):
    """`vllm serve --model ...` from the guides, with --enable-log-requests and a short stats interval,
    some of its flags in a --config file."""
    port = free_port()
    tmp = tmp_path_factory.mktemp("guide")
    (tmp / "config.yaml").write_text("served-model-name: guide\nmax-num-seqs: 16\nenable-log-requests: true\n")
    command = [sys.executable, "-m", "pagedserve", "serve", "--model", str(default_model),
               "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.9",
               "--max-model-len", str(GUIDE_MAX_MODEL_LEN), "--enable-prefix-caching", "--enforce-eager", "-tp", "1",
               "--enable-chunked-prefill", "--swap-space", "4", "--trust-remote-code",
               "--config", str(tmp / "config.yaml")]
    server = start(command, tmp, port, PAGEDSERVE_LOG_STATS_INTERVAL="0.5")
    try:
        yield server
    finally:
        if server["process"].poll() is None:
            server["process"].kill()


def talk_like_the_guides(base_url: str, model: str, http: httpx.Client | None = None) -> None:
    """curl /v1/models, a chat completion and a streamed one, as the guides do."""
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=60, http_client=http)
    assert [m.id for m in client.models.list().data] == [model]
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Who won the world series in 2020?"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def test_vllm_serve_guide(guide_server):
    talk_like_the_guides(guide_server["base_url"], "guide")


def test_stats_line_and_request_log(guide_server):
    client = openai.OpenAI(base_url=guide_server["base_url"], api_key="EMPTY", max_retries=0, timeout=60)
    client.completions.create(model="guide", prompt="The quick brown fox", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True, "top_k": 3})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = guide_server["stderr"].read_text().splitlines()
        stats = [l for l in lines if " engine_stats " in l]
        finished = [l for l in lines if " request_finished " in l and "'top_k': 3" in l]
        if stats and finished:
            break
        time.sleep(0.2)
    assert finished, "no --enable-log-requests line with the request's parameters"
    assert "completion_tokens=5" in finished[0] and "finish_reasons=['length']" in finished[0]
    assert "prompt_tokens=" in finished[0] and "elapsed_s=" in finished[0]
    assert stats, "no periodic engine_stats line while busy"
    assert [l for l in lines if " http_request " in l and "path=/v1/chat/completions" in l], "no access line"
    for field in ("prompt_tokens_per_s=", "generation_tokens_per_s=", "running=", "waiting=",
                  "kv_cache_usage_pct=", "prefix_cache_hit_rate_pct="):
        assert field in stats[-1]
    assert not [l for l in lines if "Traceback" in l]


def test_python_m_api_server_form(default_model, tmp_path):
    """`python -m vllm.entrypoints.openai.api_server --model ...`, the older form; stats and access
    lines off."""
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.entrypoints.openai.api_server", "--model", str(default_model),
               "--port", str(port), "--max-model-len", "1k", "--disable-log-stats", "--disable-log-requests",
               "--disable-uvicorn-access-log", "--disable-fastapi-docs"]
    server = start(command, tmp_path, port, PAGEDSERVE_LOG_STATS_INTERVAL="0.2")
    try:
        talk_like_the_guides(server["base_url"], str(default_model))
        time.sleep(0.5)
    finally:
        stop(server)
    log = server["stderr"].read_text()
    assert " engine_stats " not in log and " http_request " not in log


def test_serve_on_a_unix_socket(default_model, tmp_path):
    """vLLM's --uds: the API on a Unix domain socket, which httpx's transport reaches; the socket
    file is gone after shutdown."""
    path = str(tmp_path / "api.sock")
    command = [sys.executable, "-m", "pagedserve", "serve", str(default_model), "--uds", path,
               "--max-model-len", "1k"]
    with (tmp_path / "stderr.log").open("w") as err:
        process = subprocess.Popen(command, env=dict(os.environ, TMPDIR=str(tmp_path)), stderr=err)
    wait_uds(path, process, timeout=180)
    server = dict(process=process, tmp=tmp_path, children=psutil.Process(process.pid).children(recursive=True))
    try:
        talk_like_the_guides("http://localhost/v1", str(default_model),
                             httpx.Client(transport=httpx.HTTPTransport(uds=path)))
    finally:
        stop(server)
    assert not Path(path).exists()


def test_https_with_client_certificates(default_model, tmp_path):
    """vLLM's --ssl-* flags: the API over HTTPS, to clients whose certificate the CA signed only."""
    pki = make_pki(tmp_path)
    port = free_port()
    command = [sys.executable, "-m", "pagedserve", "serve", str(default_model), "--port", str(port),
               "--max-model-len", "1k", f"--ssl-certfile={pki}/service.pem", f"--ssl-keyfile={pki}/service.key",
               f"--ssl-ca-certs={pki}/ca.pem", "--ssl-cert-reqs", "2"]
    trusted = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    trusted.load_cert_chain(pki / "service.pem", pki / "service.key")
    server = start(command, tmp_path, port, trusted)
    try:
        with httpx.Client(verify=trusted) as http:
            talk_like_the_guides(server["base_url"], str(default_model), http)
        anonymous = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with httpx.Client(verify=anonymous) as http, pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=server["base_url"], api_key="EMPTY", max_retries=0,
                          http_client=http).models.list()
    finally:
        stop(server)
    assert "pagedserve_ready" in server["stderr"].read_text()


def write_config(path: Path, architectures: list[str]) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": architectures}))
    return str(path)


def write_file(path: Path) -> str:
    path.write_text("not a socket")
    return str(path)


BAD_STARTS = {
    "missing path": (lambda t, m, s: ["/nonexistent/model"], "/nonexistent/model does not exist"),
    "Hugging Face id": (lambda t, m, s: ["meta-llama/Llama-3.1-8B-Instruct"],
                        "pagedserve never downloads models: pass a local directory or .gguf file"),
    "directory without config": (lambda t, m, s: [str(t)], "has no config.json"),
    "unsupported architecture": (lambda t, m, s: [write_config(t / "gpt2", ["GPT2LMHeadModel"])],
                                 "unsupported architecture ['GPT2LMHeadModel']"),
    "port of another process": (lambda t, m, s: [str(m), "--port", str(s["listener"])],
                                "is in use by another process"),
    "port of another pagedserve": (lambda t, m, s: [str(m), "--port", str(s["pagedserve"])],
                                   "another pagedserve (pagedserve/"),
    "--uds path of a file": (lambda t, m, s: [str(m), "--uds", write_file(t / "notes.txt")],
                             "notes.txt exists and is not a socket; pass another path"),
    "context above the model's": (lambda t, m, s: [str(m), "--max-model-len", "1M"],
                                  "exceeds the model's max_position_embeddings"),
    "TLS key without its certificate": (lambda t, m, s: [str(m), "--ssl-keyfile", str(t / "key.pem")],
                                        "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
    "pipeline parallelism": (lambda t, m, s: [str(m), "-pp", "2"], "pipeline parallelism is not built yet"),
    "memory share above 1": (lambda t, m, s: [str(m), "--gpu-memory-utilization", "1.5"],
                             "--gpu-memory-utilization: must be in (0, 1]"),
    "unknown flag": (lambda t, m, s: [str(m), "--max-num-sequences", "8"],
                     "unrecognized argument --max-num-sequences; did you mean --max-num-seqs?"),
    "prefix of a flag": (lambda t, m, s: [str(m), "--gpu", "0.5"],
                         "unrecognized argument --gpu; did you mean --gpu-memory-utilization?"),
    "cuda without a GPU": (lambda t, m, s: [str(m), "--device", "cuda", "--port", "0"],
                           "torch sees no CUDA GPU"),
}


@pytest.fixture(scope="module")
def taken_ports(guide_server):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield dict(listener=held.getsockname()[1], pagedserve=guide_server["port"])


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_bad_start_fails_in_one_line(case, default_model, taken_ports, tmp_path):
    if case == "cuda without a GPU" and _has_cuda():
        pytest.skip("this machine has a GPU")
    argv, says = BAD_STARTS[case]
    work = tmp_path / "work"
    work.mkdir()
    mark = f"{case}-{os.getpid()}"
    run = subprocess.run([sys.executable, "-m", "pagedserve", "serve", *argv(work, default_model, taken_ports)],
                         env=dict(os.environ, TMPDIR=str(tmp_path),
                                  BAD_START=mark),
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert says in lines[0]
    assert not list(tmp_path.glob("pagedserve-*")), "a socket folder was left behind"
    assert not [p for p in psutil.process_iter() if _environ(p).get("BAD_START") == mark]


def _environ(process: psutil.Process) -> dict:
    try:
        return process.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
