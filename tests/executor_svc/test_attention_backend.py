"""Both backends' forward with a layer's own sliding window, logit cap and partial-rotary table:
the Triton kernels (interpreted on a CPU) against the torch references; the CPU backend's decode
step, padded to a CUDA-graph size, against the references."""
import torch

from pagedserve.executor_svc.attention_backend import (AttentionMetadata, CpuAttentionBackend,
                                                       TorchAttentionBackend, TritonAttentionBackend)
from pagedserve.executor_svc.layers.rotary import Rope, cos_sin_cache
from tests.kernels.kernel_testing import DEVICE, assert_close, random_paged_kv


def test_forward_threads_window_softcap_and_partial_rotary() -> None:
    # A 6-token chunk over 20 cached tokens and a decode over 30, 4 query heads on 2 KV heads.
    cached, new, block_size = [20, 30], [6, 1], 8
    seq_lens = [c + n for c, n in zip(cached, new)]
    k_cache, v_cache, table = random_paged_kv(seq_lens, 2, 32, block_size, torch.float32)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(DEVICE)
    seq_of = torch.tensor([0] * new[0] + [1] * new[1], device=DEVICE)
    slots = table[seq_of, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(slots, torch.tensor([0, 6, 7], dtype=torch.int32, device=DEVICE),
                             torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), table,
                             max_query_len=6, max_seq_len=31)
    q, k, v = (torch.randn(7, heads, 32, device=DEVICE) for heads in (4, 2, 2))
    q *= 4
    # Half of each head rotates.
    table_16 = cos_sin_cache(Rope(32, partial_rotary_factor=0.5), 64).to(DEVICE)
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        outs.append(backend.forward(positions, q.clone(), k.clone(), v, table_16,
                                    k_cache.clone(), v_cache.clone(), meta, 32 ** -0.5,
                                    None, sliding_window=5, softcap=2.0, out_rows=12))
    # Both pad the output to out_rows rows for o_proj (layers/linear.py's input_rows).
    assert outs[0].shape == outs[1].shape == (12, 4, 32)
    assert_close(outs[1][:7], outs[0][:7])
    outs[0] = outs[0][:7]
    plain = TorchAttentionBackend().forward(positions, q.clone(), k.clone(), v, table_16,
                                            k_cache.clone(), v_cache.clone(), meta, 32 ** -0.5,
                                            None)
    assert (plain - outs[0]).abs().max() > 0.1


def test_cpu_backend_decode_steps_padded_to_a_graph_size() -> None:
    # Three decodes padded to four rows, as the runner pads them on every device: the padding row
    # has slot -1 and context 1, and max_seq_len is the model's. Two layers of a step share its
    # plan; the next step, one token further, makes its own.
    seq_lens, block_size = [20, 31, 9], 8
    k_cache, v_cache, table = random_paged_kv([n + 1 for n in seq_lens], 2, 32, block_size, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    table = torch.cat((table.masked_fill(table >= len(k_cache), 0), torch.zeros_like(table[:1])))
    rope = cos_sin_cache(Rope(32), 64)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    backends = CpuAttentionBackend(), TorchAttentionBackend()
    for step in range(2):
        lens = [n + step for n in seq_lens]
        positions = torch.tensor([n - 1 for n in lens] + [0])
        slots = table[torch.arange(3), positions[:3] // block_size].long() * block_size + positions[:3] % block_size
        meta = AttentionMetadata(torch.cat((slots, torch.tensor([-1]))), torch.arange(5, dtype=torch.int32),
                                 torch.tensor(lens + [1], dtype=torch.int32), table,
                                 max_query_len=1, max_seq_len=4096)
        for _layer in range(2):
            q, k, v = (torch.randn(4, heads, 32) for heads in (4, 2, 2))
            outs = [backend.forward(positions, q.clone(), k.clone(), v, rope, *cache, meta, 32 ** -0.5, None)
                    for backend, cache in zip(backends, caches)]
            assert_close(outs[0][:3], outs[1][:3])
            assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_cpu_backend_decodes_after_a_mixed_step_as_the_references() -> None:
    # Decode, a step where the first sequence takes two tokens (the reference path, which the
    # contexts kept between decode steps must not miss), then decode again.
    seq_lens, block_size, heads = [20, 31, 9], 8, (4, 2, 2)
    steps = ([1, 1, 1], [2, 1, 1], [1, 1, 1], [1, 1, 1])
    # Blocks for every token the steps add (the table's padding, mapped to block 0 below, would
    # land a write past them in another sequence's block); spare ones because the contexts are
    # kept in copies of up to a quarter of the cache's tokens.
    grown = [n + sum(step[i] for step in steps) for i, n in enumerate(seq_lens)]
    k_cache, v_cache, table = random_paged_kv(grown, 2, 32, block_size, torch.float32, spare_blocks=100)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    table = table.masked_fill(table >= len(k_cache), 0)
    rope = cos_sin_cache(Rope(32), 64)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    backends = CpuAttentionBackend(), TorchAttentionBackend()
    lens = list(seq_lens)
    for new in steps:
        lens = [n + t for n, t in zip(lens, new)]
        positions = torch.cat([torch.arange(n - t, n) for n, t in zip(lens, new)])
        rows = torch.cat([torch.full((t,), i) for i, t in enumerate(new)])
        slots = table[rows, positions // block_size].long() * block_size + positions % block_size
        meta = AttentionMetadata(slots, torch.tensor([0, *new], dtype=torch.int32).cumsum(0).int(),
                                 torch.tensor(lens, dtype=torch.int32), table,
                                 max_query_len=max(new), max_seq_len=4096)
        q, k, v = (torch.randn(len(positions), h, 32) for h in heads)
        outs = [backend.forward(positions, q.clone(), k.clone(), v, rope, *cache, meta, 32 ** -0.5, None)
                for backend, cache in zip(backends, caches)]
        assert_close(outs[0], outs[1])
    assert backends[0]._contexts.buffers


def test_cpu_backend_norm_is_the_reference() -> None:
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    cpu, ref = CpuAttentionBackend(), TorchAttentionBackend()
    for dtype in (torch.float32, torch.bfloat16):
        args = x.to(dtype), weight.to(dtype), 1e-5, residual.to(dtype)
        normed, summed = cpu.rms_norm(*args)
        ref_normed, ref_summed = ref.rms_norm(*args)
        assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_summed)
        assert torch.equal(cpu.rms_norm(*args[:3])[0], ref.rms_norm(*args[:3])[0])


def test_triton_backend_writes_norm_and_activation_into_padded_buffers() -> None:
    # On a GPU a projection's input may have padding rows (layers/linear.py's input_rows).
    x, residual = torch.randn(3, 64, device=DEVICE), torch.randn(3, 64, device=DEVICE)
    weight = torch.randn(64, device=DEVICE)
    triton_backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    normed, summed = triton_backend.rms_norm(x, weight, 1e-5, residual, out_rows=8)
    ref, ref_sum = torch_backend.rms_norm(x, weight, 1e-5, residual, out_rows=8)
    assert normed.shape == ref.shape == (8, 64)
    assert_close(normed[:3], ref[:3])
    torch.testing.assert_close(summed, ref_sum)
    activated = triton_backend.silu_and_mul(x, out_rows=8)
    assert activated.shape == (8, 32)
    assert_close(activated[:3], torch_backend.silu_and_mul(x)[:3])
    assert triton_backend.rms_norm(x, weight, 1e-5, out_rows=2)[0].shape == (3, 64)
