"""The command line as a vLLM user types it: flag names, value forms, range checks and errors
(parsed only; tests/e2e/test_vllm_cli.py starts servers)."""
import json
from pathlib import Path

import pytest

from pagedserve.common.config import EXECUTOR_FLAGS, SCHEDULER_FLAGS, config_from_args, config_to_argv
from pagedserve.entrypoints.cli import also_engine, also_serve_args, build_parser, check_memory_shares

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_vllm_value_forms():
    args = parse("--max-model-len", "8k", "--max-num-batched-tokens", "1M", "--kv-cache-memory-bytes", "4G",
                 "--dtype", "half", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "16")
    assert (args.max_model_len, args.max_num_batched_tokens) == (8000, 2**20)
    assert args.kv_cache_memory_bytes == 4 * 2**30 and args.dtype == "float16"
    assert args.gpu_memory_utilization == 0.85 and args.max_num_seqs == 16
    assert parse("--max-model-len", "1.5k").max_model_len == 1500
    assert [parse("--dtype", d).dtype for d in ("float", "bfloat16", "float32", "auto")] == \
        ["float32", "bfloat16", "float32", "auto"]


def test_model_positional_or_flag_and_several_served_names():
    assert parse("/models/a").model_path == "/models/a" and parse("--model", "/models/a").model == "/models/a"
    args = parse("--model", "/models/a", "--served-model-name", "llama", "llama-3.1-8b")
    assert args.served_model_name == ["llama", "llama-3.1-8b"]
    assert config_from_args(args).name == "llama"


@pytest.mark.parametrize("argv", [["-tp", "1"], ["--tensor-parallel-size", "2"], ["--trust-remote-code"],
                                  ["--disable-log-requests"], ["--enable-log-requests"], ["--disable-log-stats"],
                                  ["--uvicorn-log-level", "warning"], ["--kv-cache-dtype", "auto"],
                                  ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"],
                                  ["--enable-prefix-caching"], ["--enforce-eager"], ["-dp", "2"],
                                  ["--data-parallel-size", "3"], ["--enable-chunked-prefill"],
                                  ["--swap-space", "16"], ["--disable-custom-all-reduce"], ["-pp", "1"],
                                  ["--pipeline-parallel-size", "1"], ["--distributed-executor-backend", "mp"],
                                  ["--tokenizer-mode", "auto"], ["--max-logprobs", "-1"], ["--max-logprobs", "0"],
                                  ["--enable-request-id-headers"], ["--enable-server-load-tracking"]])
def test_accepted_vllm_flags(argv):
    parse(*argv)


def test_a_deployment_guides_compat_flags_reach_no_process():
    """Flags for what pagedserve does anyway change no child's command line."""
    guide = parse("--enable-chunked-prefill", "--swap-space", "16", "--disable-custom-all-reduce", "-pp", "1",
                  "--distributed-executor-backend", "mp", "--tokenizer-mode", "auto", "--trust-remote-code",
                  "--max-log-len", "100", "--disable-cascade-attn", "--max-seq-len-to-capture", "8192")
    config = config_from_args(guide)
    assert config == config_from_args(parse())
    assert config_to_argv(config, EXECUTOR_FLAGS) == config_to_argv(config, SCHEDULER_FLAGS) == []


@pytest.mark.parametrize("argv, says", [
    (["-tp", "0"], "must be a positive integer"),
    (["--quantization", "awq"], "quantization other than fp8 is not built yet (only fp8 is"),
    (["--kv-cache-dtype", "fp8_e5m2"], "fp8_e5m2 KV caches are not built; use fp8 (e4m3) or auto"),
    (["--kv-cache-dtype", "int8"], "invalid choice"),
    (["--tool-call-parser", "granite"], "invalid choice"),
    (["--reasoning-parser", "granite"], "invalid choice"),
    (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["--gpu-memory-utilization", "0"], "must be in (0, 1]"),
    (["--max-num-seqs", "0"], "must be a positive integer"),
    (["-dp", "0"], "must be a positive integer"),
    (["--max-model-len", "1.5K"], "decimals do not go with binary suffixes"),
    (["--port", "70000"], "must be a TCP port"),
    (["--dtype", "int8"], "invalid choice"),
    (["-pp", "2"], "pipeline parallelism is not built yet (split a model over GPUs with -tp); drop '2'"),
    (["--distributed-executor-backend", "ray"], "a backend other than mp is not built yet"),
    (["--tokenizer-mode", "mistral"], "a tokenizer mode other than auto is not built yet"),
    (["--swap-space", "-4"], "must be 0 or more"),
    (["--max-logprobs", "-2"], "must be 0 or more, or -1 for the whole vocabulary"),
    (["--response-role", ""], "must be a name without surrounding white space"),
    (["--chat-template-content-format", "list"], "invalid choice"),
    (["--gpu", "0.5"], "unrecognized argument --gpu; did you mean --gpu-memory-utilization?"),
    (["--fully-sharded-loras"], "--fully-sharded-loras: this LoRA option is not built"),
    (["-O3"], "-O3: pagedserve does not run torch.compile"),
    (["--revision", "main"], "--revision: pagedserve loads a local directory or GGUF file and never downloads"),
    (["--speculative-config", "{}"], "--speculative-config: speculative decoding is not built yet"),
    (["--max-num-seq", "8"], "did you mean --max-num-seqs?"),
    (["--gpu-memory-utlization", "0.5"], "did you mean --gpu-memory-utilization?"),
])
def test_refused_in_one_line_naming_the_flag(capsys, argv, says):
    assert says in refused(capsys, *argv)


def test_a_config_file_gives_flags_the_command_line_does_not(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("model: /models/from-file\nmax-model-len: 8k\nmax_num_seqs: 16\n"
                      "enable-prefix-caching: false\nenforce-eager: false\ntrust-remote-code: true\n"
                      "served-model-name: [a, b]\nallowed-origins: ['https://a.example']\n"
                      "hf-overrides: {rope_theta: 10000}\nalso-serve: ['/models/e,max-model-len=512']\n")
    args = parse("--config", str(config))
    assert (args.model, args.max_model_len, args.max_num_seqs) == ("/models/from-file", 8000, 16)
    assert not args.enable_prefix_caching and not args.enforce_eager and args.trust_remote_code
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["https://a.example"]
    assert args.hf_overrides == {"rope_theta": 10000} and args.also_serve[0].options == {"max-model-len": "512"}
    cli = parse("/models/cli", f"--config={config}", "--max-num-seqs", "4", "--enable-prefix-caching")
    assert (cli.model, cli.model_path, cli.max_num_seqs, cli.enable_prefix_caching) == (None, "/models/cli", 4, True)
    assert cli.max_model_len == 8000 and cli.served_model_name == ["a", "b"]


@pytest.mark.parametrize("text, says", [
    ("max-modl-len: 8k\n", "unknown key 'max-modl-len'; did you mean max-model-len?"),
    ("- max-model-len\n", "must hold a mapping of flag names to values"),
    ("max-model-len: [\n", "is not YAML"),
    ("max-model-len:\n", "'max-model-len' has no value"),
    ("gpu-memory-utilization: 1.5\n", "argument --gpu-memory-utilization: must be in (0, 1]"),
    ("enable-expert-parallel: true\n", "enable-expert-parallel: expert parallelism is not built yet"),
])
def test_a_bad_config_file_is_refused_in_one_line(tmp_path, capsys, text, says):
    (tmp_path / "config.yaml").write_text(text)
    assert says in refused(capsys, "--config", str(tmp_path / "config.yaml"))


def test_the_gateway_gets_the_generation_config_override():
    from pagedserve.entrypoints.cli import _gateway_argv
    args = parse("--override-generation-config", '{"temperature": 0.6}')
    argv = _gateway_argv(args, config_from_args(args))
    assert argv[argv.index("--override-generation-config") + 1] == '{"temperature": 0.6}'
    assert "--override-generation-config" not in _gateway_argv(parse(), config_from_args(parse()))


def test_the_gateway_gets_the_usage_flags_given():
    from pagedserve.entrypoints.cli import _gateway_argv
    args = parse("--enable-force-include-usage", "--enable-prompt-tokens-details")
    argv = _gateway_argv(args, config_from_args(args))
    assert {"--enable-force-include-usage", "--enable-prompt-tokens-details"} <= set(argv)
    assert "--enable-force-include-usage" not in _gateway_argv(parse(), config_from_args(parse()))


def test_the_gateway_gets_the_response_role_content_format_and_output_log():
    from pagedserve.entrypoints.cli import _gateway_argv
    args = parse("--response-role", "model", "--chat-template-content-format", "openai", "--enable-log-outputs",
                 "--max-log-len", "40")
    argv = _gateway_argv(args, config_from_args(args))
    assert "--enable-log-outputs" in argv and argv[argv.index("--max-log-len") + 1] == "40"
    assert "--response-role=model" in argv
    assert argv[argv.index("--chat-template-content-format") + 1] == "openai"
    default = _gateway_argv(parse(), config_from_args(parse()))
    assert not any(a.startswith(("--response-role", "--chat-template-content-format", "--enable-log-outputs",
                                 "--max-log-len")) for a in default)


def test_the_gateway_gets_the_cors_flags_given():
    from pagedserve.entrypoints.cli import _gateway_argv
    args = parse("--allowed-origins", "https://a.example", "--allowed-headers", "authorization", "--allow-credentials")
    argv = _gateway_argv(args, config_from_args(args))
    assert argv[argv.index("--allowed-origins") + 1] == '["https://a.example"]'
    assert argv[argv.index("--allowed-headers") + 1] == '["authorization"]' and "--allow-credentials" in argv
    assert "--allowed-methods" not in argv
    assert "--allowed-origins" not in _gateway_argv(parse(), config_from_args(parse()))


def test_run_batch_refuses_https_flags_before_it_starts(tmp_path):
    from pagedserve.entrypoints import run_batch
    args = build_parser().parse_args(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                                      "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"])
    with pytest.raises(ValueError, match="without HTTPS; drop the --ssl-\\* flags"):
        run_batch.run(args, serve=None)


def test_help_shows_defaults_and_says_no_remote_code_runs(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--gpu-memory-utilization GPU_MEMORY_UTILIZATION" in text and "(default: 0.9)" in text
    assert "never runs code from a model directory" in text
    assert "--block-size BLOCK_SIZE tokens per KV-cache block (default: 16)" in text


def test_each_child_gets_its_own_flags():
    config = config_from_args(parse("--max-num-seqs", "16", "--max-model-len", "4k", "--no-enable-prefix-caching",
                                    "--served-model-name", "a", "b", "-q", "FP8", "--max-logprobs", "-1",
                                    "--logprobs-mode", "processed_logprobs", "--long-prefill-token-threshold", "512"))
    executor, scheduler = config_to_argv(config, EXECUTOR_FLAGS), config_to_argv(config, SCHEDULER_FLAGS)
    assert executor == ["--max-model-len", "4000", "--max-num-seqs", "16", "--quantization", "fp8",
                        "--max-logprobs", "-1", "--logprobs-mode", "processed_logprobs"]
    assert scheduler == ["--served-model-name", "a", "b", "--no-enable-prefix-caching",
                         "--long-prefill-token-threshold", "512"]
    build_parser().parse_args(["executor", *executor])
    build_parser().parse_args(["scheduler", *scheduler])


def dockerfile_entrypoint() -> list[str]:
    line = next(l for l in (ROOT / "Dockerfile").read_text().splitlines() if l.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT"))


@pytest.mark.parametrize("user_args", [["--model", "/models/X"], ["/models/X"],
                                       ["/models/X", "--max-model-len", "8k", "-tp", "1"]])
def test_docker_run_arguments_follow_serve(user_args):
    entrypoint = dockerfile_entrypoint()
    assert entrypoint[0] == "pagedserve"
    args = build_parser().parse_args(entrypoint[1:] + user_args)
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert (args.model or args.model_path) == "/models/X"


def test_chat_template_from_a_file_or_inline(tmp_path, capsys):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert parse("--chat-template", str(tmp_path / "t.jinja")).chat_template == template
    assert parse("--chat-template", template).chat_template == template
    assert "neither a file nor a Jinja template" in refused(capsys, "--chat-template", str(tmp_path / "none.jinja"))
    assert "does not compile" in refused(capsys, "--chat-template", "{% for %}")


def test_an_also_served_model_takes_its_keys_and_the_machines_flags_of_the_main_model():
    main = parse("/models/chat", "--device", "cpu", "--dtype", "bfloat16", "--max-model-len", "4k",
                 "--gpu-memory-utilization", "0.6", "--served-model-name", "chat",
                 "--also-serve", "/models/bge,served-model-name=bge,text-embedding-3-small,"
                                 "gpu-memory-utilization=0.3,max-num-seqs=8,enforce-eager=true")
    also = config_from_args(also_serve_args(main.also_serve[0], main))
    assert (also.model, also.served_model_name, also.gpu_memory_utilization) == (
        "/models/bge", ["bge", "text-embedding-3-small"], 0.3)
    # The machine's flags follow the main model; its model's own (context length) do not.
    assert (also.device, also.dtype, also.max_num_seqs, also.enforce_eager, also.max_model_len) == (
        "cpu", "bfloat16", 8, True, None)
    check_memory_shares(config_from_args(main), [also])


def test_the_gateway_is_told_each_also_served_models_scheduler_names_and_templates(tmp_path):
    template = tmp_path / "score.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    main = parse("/models/chat", "--also-serve", "/models/rerank,served-model-name=rr,reranker,max-model-len=512,"
                 f"chat-template={template},runner=pooling")
    engine = also_engine(also_serve_args(main.also_serve[0], main), ["--log-level", "info"])
    spec = engine.gateway_spec("unix:///run/s.sock")
    assert spec == ("/models/rerank,scheduler-address=unix:///run/s.sock,served-model-name=rr,reranker,"
                    f"generation-config=auto,chat-template={template}")
    gateway = build_parser().parse_args(["gateway", "/models/chat", "--also-serve", spec]).also_serve[0]
    assert gateway.options["served-model-name"] == "rr,reranker"
    assert engine.argv["executor"] == ["--max-model-len", "512", "--runner", "pooling", "--log-level", "info"]
    assert engine.argv["scheduler"] == ["--served-model-name", "rr", "reranker", "--log-level", "info"]


def test_engines_sharing_a_gpu_may_not_ask_for_more_than_all_its_memory():
    main = parse("/models/chat", "--gpu-memory-utilization", "0.6", "--also-serve",
                 "/models/bge,gpu-memory-utilization=0.3", "--also-serve", "/models/rerank,gpu-memory-utilization=0.1")
    configs = [config_from_args(also_serve_args(spec, main)) for spec in main.also_serve]
    check_memory_shares(config_from_args(main), configs)
    with pytest.raises(ValueError, match=r"ask for 0\.9 \+ 0\.3 \+ 0\.1 = 1\.30 of its memory, more than 1"):
        check_memory_shares(config_from_args(parse("/models/chat")), configs)
    # A CPU has no share to split.
    check_memory_shares(config_from_args(parse("/models/chat", "--device", "cpu")), configs)


def test_an_unknown_also_serve_key_is_refused_naming_the_closest_flag(capsys):
    main = parse("/models/chat", "--also-serve", "/models/bge,gpu-memory=0.3")
    with pytest.raises(SystemExit):
        also_serve_args(main.also_serve[0], main)
    assert "--also-serve /models/bge: error: unrecognized argument --gpu-memory; did you mean " \
           "--gpu-memory-utilization?" in capsys.readouterr().err
