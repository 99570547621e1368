"""On a CUDA GPU, in bf16: a tiny Qwen3-MoE through the Triton route and fused MoE kernels, its
decode steps in CUDA graphs and eagerly, with bf16 and with FP8 experts. Each greedy token must
be the one an eager prefill over the same context ranks first (teacher-forced), and mostly
transformers' choice too."""
import gc

import pytest
import torch
import transformers

from pagedserve import LLM
from pagedserve.executor_svc.attention_backend import TritonAttentionBackend
from tests.executor_svc.harness import paged_prefill_logits
from tests.executor_svc.test_gpu_parity import prompts  # noqa: F401 (the fixture)
from tests.tiny_models import llm_greedy, make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU of compute capability 8.9+ (FP8 experts)")
CUDA = torch.device("cuda")
NEW_TOKENS = 48
# Per-token agreement of two bf16 computations: a rounding may flip a near tie of this random
# model, and a flipped router choice changes a token's experts (test_gpu_parity explains why
# whole sequences are not compared).
MIN_AGREEMENT = 0.95


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen3moe"))


def greedy(path, prompts: list[list[int]], **llm_kwargs) -> tuple[list[list[int]], bool]:
    """The engine's greedy tokens and whether it captured CUDA graphs; its memory given back."""
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8,
              num_gpu_blocks_override=256, **llm_kwargs)
    tokens, graphs = llm_greedy(llm, prompts, NEW_TOKENS), bool(llm.worker.runner.graphs.graphs)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, graphs


def agreement(prompts: list[list[int]], outputs: list[list[int]], ranked: list[list[int]]) -> float:
    agree = sum(a == b for out, first in zip(outputs, ranked) for a, b in zip(out, first))
    return agree / (len(prompts) * NEW_TOKENS)


def ranked_first(path, prompts: list[list[int]], outputs: list[list[int]],
                 fp8: bool = False) -> list[list[int]]:
    """The token our eager bf16 prefill ranks first after each prefix of prompt + output."""
    logits = paged_prefill_logits(path, [p + o for p, o in zip(prompts, outputs)], TritonAttentionBackend(),
                                  CUDA, torch.bfloat16, fp8=fp8)
    return [row[len(p) - 1:-1].argmax(-1).tolist() for p, row in zip(prompts, logits)]


def hf_ranked_first(path, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        return [hf(torch.tensor([p + o], device="cuda")).logits[0, len(p) - 1:-1].argmax(-1).tolist()
                for p, o in zip(prompts, outputs)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_tokens_are_those_an_eager_prefill_ranks_first(model_path, prompts, enforce_eager):
    outputs, graphs = greedy(model_path, prompts, enforce_eager=enforce_eager)
    assert graphs != enforce_eager
    ours = agreement(prompts, outputs, ranked_first(model_path, prompts, outputs))
    theirs = agreement(prompts, outputs, hf_ranked_first(model_path, prompts, outputs))
    print(f"greedy tokens ranked first ({'eager' if enforce_eager else 'cuda graphs'}): "
          f"by our prefill {ours:.3f}, by transformers {theirs:.3f}")
    assert ours >= MIN_AGREEMENT and theirs >= MIN_AGREEMENT


def test_fp8_experts_under_cuda_graphs(model_path, prompts):
    # Against an eager engine's FP8 decode, not an FP8 prefill: decode rows of up to 16 read the
    # experts W8A16 where a prefill quantizes its activations (W8A8); graph decoding agreed
    # with such a prefill on 0.865 of this random model's tokens (H200).
    outputs, graphs = greedy(model_path, prompts, quantization="fp8")
    eager, _ = greedy(model_path, prompts, quantization="fp8", enforce_eager=True)
    assert graphs
    same = agreement(prompts, outputs, eager)
    print(f"FP8 greedy tokens under CUDA graphs equal to eager FP8 decoding: {same:.3f}")
    assert same >= MIN_AGREEMENT
