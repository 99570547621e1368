"""q/k norms (Qwen3, Qwen3-MoE, Gemma 3) run inside the rotary kernel on the Triton backend
(interpreted on a CPU): the same logits as the references', which norm q and k apart first."""
import pytest
import torch

from pagedserve.executor_svc.attention_backend import TorchAttentionBackend, TritonAttentionBackend
from tests.executor_svc.harness import paged_prefill_logits
from tests.kernels.kernel_testing import DEVICE, assert_close
from tests.tiny_models import make_tiny_model, mixed_prompts


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"])
def test_q_and_k_normed_in_the_rotary_kernel(tmp_path, arch: str) -> None:
    path = make_tiny_model(arch, tmp_path)
    prompts = mixed_prompts(seed=5)[:4]
    fused, apart = (torch.cat(paged_prefill_logits(path, prompts, backend, DEVICE))
                    for backend in (TritonAttentionBackend(), TorchAttentionBackend()))
    assert_close(fused, apart)
