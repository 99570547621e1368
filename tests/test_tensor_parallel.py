"""Tensor parallelism on the CPU over gloo: -tp 2 gives -tp 1's greedy tokens through the offline
LLM (preemption and prefix caching included), each rank holds only its slice of each weight, and
a size that does not divide the model is refused in one line."""
import re
import subprocess
import sys

import psutil
import pytest
import torch
from safetensors.torch import load_file

from pagedserve import LLM
from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.model_config import load_model_config
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.models import build_model
from pagedserve.executor_svc.parallel import TensorParallel, shard_config
from pagedserve.executor_svc.weight_loader import checkpoint_targets, load_weights
from tests.serving import run_cli
from tests.test_llm_equivalence import shared_prefix_prompts
from tests.tiny_gguf import Q, write_gguf
from tests.tiny_models import llm_greedy, make_tiny_model, mixed_prompts

NEW_TOKENS = 32
# Llama with every bias (o_proj's and down_proj's are on rank 0 only); Qwen2 with tied embeddings.
MODELS = {"LlamaForCausalLM": dict(attention_bias=True, mlp_bias=True), "Qwen2ForCausalLM": {}}
# 40 blocks of 4 tokens cannot hold the eight requests at once: they preempt each other.
SMALL_POOL = dict(block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=24, max_model_len=128,
                  enable_prefix_caching=True)


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), **MODELS[request.param])


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # A CPU rank takes its share of the cores; this process is rank 0.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def rank_model(path, rank: int) -> CausalLM:
    """Rank `rank` of 2's model, loaded as that rank loads it (no process group: it never runs)."""
    config = load_model_config(path)
    model = build_model(shard_config(config, 2), TorchAttentionBackend(), 64, TensorParallel(rank, 2))
    load_weights(model, path, "auto")
    return model


def generate_all(llm: LLM) -> dict[str, list[list[int]]]:
    return {name: llm_greedy(llm, prompts, NEW_TOKENS)
            for name, prompts in (("mixed", mixed_prompts(0)), ("shared", shared_prefix_prompts(1)))}


def test_tp2_gives_tp1_greedy_tokens_under_preemption_and_prefix_caching(model, capfd):
    expected = generate_all(LLM(str(model), **SMALL_POOL))
    llm = LLM(str(model), tensor_parallel_size=2, **SMALL_POOL)
    assert generate_all(llm) == expected
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.prefix_cache_hits > 0
    shapes = {name: p.shape for name, p in llm.worker.model.named_parameters()}
    assert shapes == {name: p.shape for name, p in rank_model(model, 0).named_parameters()}
    # By its model too: a rank-1 process of an earlier test may still be writing to this stderr.
    line = next(line for line in capfd.readouterr().err.splitlines()
                if "model_loaded" in line and "rank=1" in line and f"model={model}" in line)
    assert int(re.search(r"parameters=(\d+)", line)[1]) == sum(p.numel() for p in rank_model(model, 1).parameters())


def assert_ranks_hold_slices(path, tensors: dict[str, torch.Tensor]) -> None:
    """The two ranks' slices of each checkpoint tensor put together are the whole `tensors`."""
    ranks = [checkpoint_targets(rank_model(path, rank)) for rank in (0, 1)]
    for name, tensor in tensors.items():
        held = [targets[name] for targets in ranks if targets[name] is not None]
        if held[0].parts == 1:
            # Replicated (norms), or a row-parallel bias that only rank 0 holds.
            assert all(torch.equal(t.view, tensor) for t in held), name
            continue
        assert [t.rank for t in held] == [0, 1], name
        assert torch.equal(torch.cat([t.view for t in held], held[0].dim), tensor), name


def test_each_rank_holds_its_slice_of_every_tensor(model):
    tensors = load_file(model / "model.safetensors")
    assert_ranks_hold_slices(model, tensors)
    whole = sum(t.numel() for t in tensors.values())
    assert all(sum(p.numel() for p in rank_model(model, r).parameters()) < 0.6 * whole for r in (0, 1))


def test_gguf_ranks_dequantize_their_blocks_of_each_tensor(tmp_path):
    # Q8_0 blocks of 32 columns: o_proj's and down_proj's halves start on a block; q/k rows are
    # un-permuted per head after slicing.
    path = write_gguf(make_tiny_model("LlamaForCausalLM", tmp_path / "hf"), tmp_path / "model.gguf",
                      outtype=Q.Q8_0)
    whole = build_model(load_model_config(path), TorchAttentionBackend(), 64)
    load_weights(whole, path, "auto")
    assert_ranks_hold_slices(path, {name: t.view for name, t in checkpoint_targets(whole).items()})


def test_rank_0_alone_holds_a_row_parallel_bias(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path, attention_bias=True)
    first, second = rank_model(path, 0), rank_model(path, 1)
    assert first.model.layers[0].self_attn.o_proj.bias is not None
    assert second.model.layers[0].self_attn.o_proj.bias is None
    assert first.model.layers[0].self_attn.qkv_proj.weight.shape == (64, 64)
    assert first.model.layers[0].self_attn.o_proj.weight.shape == (64, 32)


def test_dummy_weights_are_the_same_slices_at_every_size(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    config = load_model_config(path)
    whole = build_model(config, TorchAttentionBackend(), 64)
    load_weights(whole, path, "dummy")
    halves = []
    for rank in (0, 1):
        half = build_model(shard_config(config, 2), TorchAttentionBackend(), 64, TensorParallel(rank, 2))
        load_weights(half, path, "dummy")
        halves.append(half)
    down = [h.model.layers[1].mlp.down_proj.weight for h in halves]
    assert torch.equal(torch.cat(down, 1), whole.model.layers[1].mlp.down_proj.weight)
    embed = [h.model.embed_tokens.weight for h in halves]
    assert torch.equal(torch.cat(embed, 0), whole.model.embed_tokens.weight)


def test_sizes_that_do_not_divide_the_model_are_refused_in_one_line(tmp_path, capsys):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    with pytest.raises(ValueError) as refused:
        LLM(str(path), tensor_parallel_size=4)
    assert str(refused.value) == ("--tensor-parallel-size 4 does not divide the model's KV heads 2; "
                                  "use -tp 1, 2")
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 3 does not divide the model's attention "
                                         r"heads 4 and KV heads 2 and intermediate size 128 and vocabulary "
                                         r"size 512; use -tp 1, 2$"):
        run_cli(["executor", str(path), "-tp", "3", "--address", f"unix://{tmp_path}/x.sock"])


def test_rank_1_dies_with_rank_0(tmp_path):
    model = make_tiny_model("Qwen2ForCausalLM", tmp_path)
    script = (f"import os, signal; from pagedserve import LLM; llm = LLM({str(model)!r}, tensor_parallel_size=2); "
              "print(llm.worker.ranks.processes[0].pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    rank0 = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert rank0.returncode == -9, rank0.stderr
    rank1 = int(rank0.stdout.split()[-1])
    gone, alive = psutil.wait_procs([psutil.Process(rank1)] if psutil.pid_exists(rank1) else [], timeout=10)
    assert not alive, "rank 1 outlived rank 0"
