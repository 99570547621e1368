"""The reference's sliding window and soft-capping against transformers' own: its mask functions
and Gemma 2's eager attention. The kernels are tested against this reference."""
from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config
from transformers.masking_utils import (create_sliding_window_causal_mask,
                                        sliding_window_causal_mask_function)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from pagedserve.kernels.reference import paged_attention_ref, visible_keys
from tests.kernels.kernel_testing import random_paged_kv

SHAPE = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=32, vocab_size=10, sliding_window=4)


@pytest.mark.parametrize("config", [
    MistralConfig(**SHAPE),
    Qwen2Config(use_sliding_window=True, max_window_layers=0, **SHAPE),
    Gemma2Config(**SHAPE),
    Gemma3TextConfig(**SHAPE),
], ids=lambda c: c.model_type)
def test_window_is_the_models_own_in_transformers(config) -> None:
    config._attn_implementation = "eager"
    pos = torch.arange(9)
    mask = create_sliding_window_causal_mask(config, torch.zeros(1, 9, 16), None, None,
                                             position_ids=pos[None])
    # A window of 4: the query at 6 sees keys 3 to 6.
    assert torch.equal(mask[0, 0] == 0, visible_keys(pos, pos, 4))
    assert visible_keys(pos, pos, 4)[6].nonzero().flatten().tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize("window", [1, 3, 8, 64])
def test_window_of_a_chunk_mid_sequence(window: int) -> None:
    q_pos, k_pos = torch.arange(10, 20), torch.arange(20)
    theirs = sliding_window_causal_mask_function(window)(0, 0, q_pos[:, None], k_pos[None, :])
    assert torch.equal(visible_keys(q_pos, k_pos, window), theirs)


def test_reference_is_gemma2_eager_attention() -> None:
    """The last 5 queries of a 12-token prompt (a chunk over a cached prefix) under a window of
    5 and a soft cap of 3, against Gemma 2's attention over the whole prompt."""
    seq_len, chunk, group, head_dim = 12, 5, 2, 16
    config = Gemma2Config(**{**SHAPE, "sliding_window": 5, "attn_logit_softcapping": 3.0})
    config._attn_implementation = "eager"
    k_cache, v_cache, table = (t.cpu() for t in random_paged_kv([seq_len], 1, head_dim, 4,
                                                                torch.float32))
    k, v = (c[table[0, :3].long()].reshape(seq_len, 1, head_dim) for c in (k_cache, v_cache))
    q = 4 * torch.randn(seq_len, group, head_dim)
    mask = create_sliding_window_causal_mask(config, torch.zeros(1, seq_len, 16), None, None,
                                             position_ids=torch.arange(seq_len)[None])
    theirs, _ = eager_attention_forward(
        SimpleNamespace(num_key_value_groups=group, training=False),
        *(x.transpose(0, 1)[None] for x in (q, k, v)), mask, scaling=0.25, softcap=3.0)
    ours = paged_attention_ref(q[-chunk:], k_cache, v_cache, table,
                               torch.tensor([seq_len]), torch.tensor([0, chunk]), 0.25,
                               sliding_window=5, softcap=3.0)
    torch.testing.assert_close(ours, theirs[0, -chunk:])
