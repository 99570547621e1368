"""The attention backend: the kernels the model runs, behind one object a Triton backend can replace.

The model calls `backend.forward` once per layer for rotary embedding, KV-cache write and paged
attention (with the layer's own rotary table, sliding window and logit cap),
`backend.rms_norm`, `backend.silu_and_mul` or `backend.gelu_tanh_and_mul` for the other elementwise
kernels, and `backend.per_token_quant_fp8` for the activations of FP8 linear layers (or
`rms_norm_quant_fp8` and `silu_and_mul_quant_fp8` / `gelu_tanh_and_mul_quant_fp8`, which quantize
their own output for them), and `backend.route` and `backend.fused_moe` for a mixture of experts.
TorchAttentionBackend (the CPU backend) runs the pure-torch references; TritonAttentionBackend
(CUDA) runs the kernels of `kernels/`.

`forward`, `rms_norm` and the gated activations (not quantizing) take `out_rows`: their output, which
a projection reads, then has max(T, out_rows) rows, the rows past T padding whose products the
caller drops (layers/linear.py's input_rows says why).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels.activation import (gelu_tanh_and_mul, gelu_tanh_and_mul_quant_fp8,
                                           silu_and_mul, silu_and_mul_quant_fp8)
from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels.cpu_attention import (DecodeContexts, DecodePlan, decode_attention_cpu, decode_plan,
                                              prefill_attention_cpu, rotate, rotation, write_kv_cpu)
from pagedserve.kernels.fused_moe import fused_moe
from pagedserve.kernels.moe_routing import route
from pagedserve.kernels.norm import rms_norm, rms_norm_quant_fp8
from pagedserve.kernels.quant import per_token_quant_fp8
from pagedserve.kernels.reference import (fused_moe_ref, gelu_tanh_and_mul_quant_fp8_ref,
                                          gelu_tanh_and_mul_ref, paged_attention_ref,
                                          per_token_quant_fp8_ref, route_ref,
                                          rms_norm_quant_fp8_ref, rms_norm_ref, rotary_ref,
                                          is_fp8, silu_and_mul_quant_fp8_ref, silu_and_mul_ref,
                                          write_kv_ref)
from pagedserve.kernels.rotary import rotary_write_kv

# (q_weight, k_weight, eps): RMSNorms of each q and k head (Qwen3's q_norm and k_norm).
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flattened batch, in the layouts described in kernels/reference.py.

    max_query_len and max_seq_len are host-known upper bounds; a CUDA graph fixes them (and
    num_splits) at capture so that its kernels keep one launch configuration."""
    slot_mapping: torch.Tensor     # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor         # [num_seqs] int32
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    num_splits: int | None = None
    # Sequences with one query token (decode rows), host-known: see paged_attention.
    num_decode_seqs: int = 0


class TorchAttentionBackend:
    """Pure-torch kernels: the CPU backend and the ground truth for the faster ones."""
    per_token_quant_fp8 = staticmethod(per_token_quant_fp8_ref)
    rms_norm_quant_fp8 = staticmethod(rms_norm_quant_fp8_ref)
    silu_and_mul_quant_fp8 = staticmethod(silu_and_mul_quant_fp8_ref)
    gelu_tanh_and_mul_quant_fp8 = staticmethod(gelu_tanh_and_mul_quant_fp8_ref)
    # route(router_logits [T, E], top_k, renormalize) -> (weights [T, k] float32, expert ids [T, k]);
    # fused_moe(x, w13, w2, weights, ids, w13_scale=None, w2_scale=None) -> [T, H]: layouts in
    # kernels/fused_moe.py. The reference quantizes FP8 experts' activations per token (W8A8),
    # as an FP8 linear layer does off a GPU.
    route = staticmethod(route_ref)
    fused_moe = staticmethod(fused_moe_ref)
    # Whether a model's RMSNorms may be folded into the projections after them
    # (layers/decoder.py's fold_norms): forward and the gated activations then take `norm_of`.
    folds_norms = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed, summed = rms_norm_ref(x, weight, eps, residual)
        return with_rows(normed, out_rows), summed

    def silu_and_mul(self, x: torch.Tensor, out_rows: int = 0) -> torch.Tensor:
        return with_rows(silu_and_mul_ref(x), out_rows)

    def gelu_tanh_and_mul(self, x: torch.Tensor, out_rows: int = 0) -> torch.Tensor:
        return with_rows(gelu_tanh_and_mul_ref(x), out_rows)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scales: tuple[torch.Tensor, torch.Tensor], *,
                sliding_window: int | None = None, softcap: float | None = None,
                out_rows: int = 0, qk_norm: QKNorm | None = None) -> torch.Tensor:
        """RMS-norms q's and k's heads by qk_norm=(q_weight, k_weight, eps) if given (Qwen3),
        rotates q and k by their positions [T], writes this step's k, v into the paged cache,
        then attends q over each context.

        q [T, heads, head_dim], k and v [T, kv_heads, head_dim]; returns [max(T, out_rows), heads,
        head_dim], the attention output in its first T rows.
        q and k may be left rotated in place (the Triton backend does). cos_sin_cache is the
        layer's rotary table (see layers/rotary.py: its width is the rotated part of each head).
        kv_scales: the layer's K and V scales, which an fp8 cache divides by when written and
        multiplies by when read. sliding_window: the layer's window (a query at i sees keys
        j > i - sliding_window; None: all earlier ones); softcap: its attention logit cap
        (None: none)."""
        q, k = rotary_ref(positions, *self.qk_normed(q, k, qk_norm), cos_sin_cache)
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return with_rows(self.attend(q, k_cache, v_cache, meta, scale, kv_scales, sliding_window, softcap),
                         out_rows)

    def qk_normed(self, q: torch.Tensor, k: torch.Tensor,
                  qk_norm: QKNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        if qk_norm is None:
            return q, k
        q_weight, k_weight, eps = qk_norm
        return self.rms_norm(q, q_weight, eps)[0], self.rms_norm(k, k_weight, eps)[0]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, kv_scales: tuple[torch.Tensor, torch.Tensor],
               sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        """forward's attention of the rotated q over the cache, this step's keys written."""
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale, kv_scales, sliding_window, softcap)


class CpuAttentionBackend(TorchAttentionBackend):
    """The references, but a decode step's attention in one SDPA call for the whole batch over a
    plan its first layer makes and the rows' contexts kept between decode steps
    (kernels/cpu_attention.py), its cache write without a mask, and
    float32 norms in torch's one call: on a CPU a decode step's small ops cost more than its
    arithmetic. Prefill chunks and sliding windows take the references' rotary and cache write,
    then an SDPA call a sequence; soft caps and fp8 caches the references throughout."""

    def __init__(self) -> None:
        self._plan: tuple[AttentionMetadata, torch.Tensor, DecodePlan] | None = None
        self._contexts = DecodeContexts()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not x.dtype == weight.dtype == torch.float32:
            return super().rms_norm(x, weight, eps, residual, out_rows)
        if residual is not None:
            x = residual = x + residual
        # torch's own RMSNorm, equal to the reference's bit for bit in float32, in one call.
        return with_rows(torch.rms_norm(x, weight.shape, weight, eps), out_rows), residual

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scales: tuple[torch.Tensor, torch.Tensor], *,
                sliding_window: int | None = None, softcap: float | None = None,
                out_rows: int = 0, qk_norm: QKNorm | None = None) -> torch.Tensor:
        q, k = self.qk_normed(q, k, qk_norm)
        if meta.max_query_len > 1:
            # A prefill can rewrite a kept row's blocks and leave it one token past its copy (a
            # preempted request recomputed into the blocks it had).
            self._contexts.forget()
        if meta.max_query_len > 1 or sliding_window or softcap or is_fp8(k_cache):
            return super().forward(positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta, scale,
                                   kv_scales, sliding_window=sliding_window, softcap=softcap,
                                   out_rows=out_rows)
        plan = self._decode_plan(positions, meta, k_cache)
        n = plan.rows
        cos, sin = rotation(plan, cos_sin_cache)
        key, value = rotate(first_rows(k, n), cos, sin), first_rows(v, n)
        write_kv_cpu(key, value, k_cache, v_cache, plan.slots)
        context = self._contexts.contexts(key, value, k_cache, v_cache, plan)
        out = decode_attention_cpu(rotate(first_rows(q, n), cos, sin), *context, plan, scale)
        return with_rows(out if n == len(q) else torch.cat((out, q[n:])), out_rows)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, kv_scales: tuple[torch.Tensor, torch.Tensor],
               sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        if softcap or is_fp8(k_cache):
            return super().attend(q, k_cache, v_cache, meta, scale, kv_scales, sliding_window, softcap)
        return prefill_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, scale, sliding_window)

    def _decode_plan(self, positions: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor) -> DecodePlan:
        """The step's plan, made by its first layer: every layer of a forward gets the same
        positions and metadata objects (held here, so that a new step's cannot reuse their ids)."""
        if self._plan is None or self._plan[0] is not meta or self._plan[1] is not positions:
            num_blocks, block_size = k_cache.shape[:2]
            plan = decode_plan(positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, block_size)
            self._contexts.prepare(plan, num_blocks * block_size)
            self._plan = (meta, positions, plan)
        return self._plan[2]


class TritonAttentionBackend(TorchAttentionBackend):
    """The Triton kernels: rotary works in place, and no kernel reads a device value on the host."""
    per_token_quant_fp8 = staticmethod(per_token_quant_fp8)
    rms_norm_quant_fp8 = staticmethod(rms_norm_quant_fp8)
    silu_and_mul_quant_fp8 = staticmethod(silu_and_mul_quant_fp8)
    gelu_tanh_and_mul_quant_fp8 = staticmethod(gelu_tanh_and_mul_quant_fp8)
    route = staticmethod(route)
    fused_moe = staticmethod(fused_moe)
    folds_norms = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = padded_rows(x, out_rows, *x.shape[1:])
        return out, rms_norm(x, weight, eps, residual, out[:len(x)])[1]

    def silu_and_mul(self, x: torch.Tensor, out_rows: int = 0,
                     norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        return _gated(silu_and_mul, x, out_rows, norm_of)

    def gelu_tanh_and_mul(self, x: torch.Tensor, out_rows: int = 0,
                          norm_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        return _gated(gelu_tanh_and_mul, x, out_rows, norm_of)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scales: tuple[torch.Tensor, torch.Tensor], *,
                sliding_window: int | None = None, softcap: float | None = None,
                out_rows: int = 0, qk_norm: QKNorm | None = None,
                norm_of: tuple[torch.Tensor, float] | None = None,
                bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """norm_of, bias: see kernels/rotary.py's rotary_write_kv."""
        # One launch for the q/k norms, rotary and the cache write: a decode step is bound by
        # small launches.
        q = rotary_write_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                            meta.slot_mapping, kv_scales, norm_of, qk_norm, bias)
        # A prefill launch reads this step's keys (rotated in place above) and values from k
        # and v rather than from their cache slots; decode steps, the ones CUDA graphs capture,
        # read the cache alone.
        k_new, v_new = (k, v) if meta.max_query_len > 1 else (None, None)
        out = padded_rows(q, out_rows, *q.shape[1:])
        paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, scale, max_query_len=meta.max_query_len,
                        max_seq_len=meta.max_seq_len, num_splits=meta.num_splits,
                        out=out[:len(q)], kv_scales=kv_scales, k_new=k_new, v_new=v_new,
                        num_decode_seqs=meta.num_decode_seqs, sliding_window=sliding_window,
                        softcap=softcap)
        return out


def first_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x's first rows, without a slicing op where that is all of them (a CPU decode step's ops
    are most of its time: a slice of one row took 3.9 us on the 2-core machine)."""
    return x if rows == len(x) else x[:rows]


def padded_rows(x: torch.Tensor, out_rows: int, *row_shape: int) -> torch.Tensor:
    """An empty buffer of max(len(x), out_rows) rows of row_shape, in x's dtype and device: the
    output of a kernel over x's rows that a projection reads (see the module's docstring)."""
    return x.new_empty(max(len(x), out_rows), *row_shape)


def with_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x, or x in the first rows of a buffer of `rows` rows where x has fewer."""
    if rows <= len(x):
        return x
    out = padded_rows(x, rows, *x.shape[1:])
    out[:len(x)] = x
    return out


def _gated(act: Callable[..., torch.Tensor], x: torch.Tensor, out_rows: int,
           norm_of: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """A gated activation kernel's output for x [T, 2 * d] written into the first rows of a
    buffer of max(T, out_rows) rows."""
    out = padded_rows(x, out_rows, x.shape[1] // 2)
    act(x, out[:len(x)], norm_of)
    return out


def get_backend(device: torch.device) -> TorchAttentionBackend:
    if device.type == "cuda":
        return TritonAttentionBackend()
    return CpuAttentionBackend()
