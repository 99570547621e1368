"""Pure-torch references of every kernel: the CPU backend, and the ground truth for kernel tests.

Layouts shared with the Triton kernels:
- KV cache of one layer: k_cache and v_cache, each [num_blocks, block_size, num_kv_heads, head_dim].
- A flattened batch: q [num_tokens, num_heads, head_dim], sequences packed one after another;
  query_start_loc [num_seqs + 1] (cu_seqlens of the queries), seq_lens [num_seqs] (context length
  after this step, cached tokens plus new ones), block_tables [num_seqs, max_blocks_per_seq].
- slot_mapping [num_tokens]: block_id * block_size + offset, or -1 for a padding token to skip.
- An fp8 (float8_e4m3fn) cache holds x / scale saturated to +-448, with one float32 scale per
  layer for K and one for V ([] tensors); other caches hold x as it is and take no scale.
"""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
FP8_INV_MAX = 1.0 / FP8_MAX
# vLLM's floor on a dynamic scale: an all-zero row (CUDA-graph padding) divides by it, not by 0.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x in the cache's storage: divided by the scale and saturated for fp8, else only cast."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x as float32 values, times its scale if one is given (an fp8 cache's, FP8 weights' or
    activations')."""
    return x.float() if scale is None else x.float() * scale


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_scale, v_scale = kv_scales or (None, None)
    k_cache[blocks, offsets] = quantize_kv(key[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize_kv(value[keep], v_cache.dtype, v_scale)


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor,
                 sliding_window: int | None = None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: the query at absolute position i sees the key at j iff
    j <= i and, with a sliding window W, i - j < W (W keys, itself included), the mask of
    transformers' sliding_window_causal_mask_function for Mistral, Qwen2 and Gemma 2 / 3."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window:
        visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
    return visible


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping, softcap * tanh(scores / softcap); None: none."""
    return scores if not softcap else softcap * torch.tanh(scores / softcap)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        sliding_window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context: the keys of
    `visible_keys` (all earlier ones without a sliding window), on scaled scores soft-capped
    when `softcap` is given."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_scale, v_scale = kv_scales if kv_scales is not None and is_fp8(k_cache) else (None, None)
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        query_len = q_hi - q_lo
        if query_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[i, :num_blocks].long()
        k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = dequantize(k.repeat_interleave(group, dim=1).transpose(0, 1), k_scale)
        v = dequantize(v.repeat_interleave(group, dim=1).transpose(0, 1), v_scale)
        qs = q[q_lo:q_hi].transpose(0, 1).float()
        scores = soft_cap(torch.matmul(qs, k.transpose(1, 2)) * scale, softcap)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(~visible_keys(q_pos, k_pos, sliding_window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, without a call where it is already: `.to` took 2.4 us on a tensor of its own
    dtype (the 2-core machine), and a CPU decode step makes a few a layer."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim; with `residual`, normalises x + residual and returns that sum too."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype), residual


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as Hugging Face Llama applies it.

    q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], positions [T],
    cos_sin_cache [max_positions, rotary_dim]: cos in the first half, sin in the second. Only
    the first rotary_dim dims of each head rotate (partial rotary); the others pass through.
    """
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, x[..., 2 * half:]), dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] holding gate then up projections; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return cast(torch.nn.functional.silu(cast(gate, torch.float32)) * cast(up, torch.float32), x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] holding gate then up projections; returns gelu_tanh(gate) * up (GeGLU with
    the tanh approximation of GELU, Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype)


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (FP8 E4M3 [T, K], float32 scale [T, 1]), each row scaled by absmax / 448 so
    that q * scale ~ x. Quantizes weights per output channel too (one row per channel)."""
    xf = x.float()
    # Products with reciprocals, as the kernels compute them: torch on a GPU divides by a Python
    # scalar as a product with its reciprocal anyway, and by a tensor exactly.
    scale = (xf.abs().amax(dim=-1, keepdim=True) * FP8_INV_MAX).clamp(min=FP8_MIN_SCALE)
    return (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def rms_norm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | None = None
                           ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """RMSNorm (rounded to x's dtype) quantized per token: ((FP8, scale), x + residual or None)."""
    normed, summed = rms_norm_ref(x, weight, eps, residual)
    return per_token_quant_fp8_ref(normed.reshape(-1, normed.shape[-1])), summed


def silu_and_mul_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up (rounded to x's dtype) quantized per token: (FP8 [T, d], scale [T, 1])."""
    out = silu_and_mul_ref(x)
    return per_token_quant_fp8_ref(out.reshape(-1, out.shape[-1]))


def route_ref(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, top_k], expert ids [T, top_k]): the top_k of
    the softmax over all experts, largest first, divided by their sum if `renormalize`."""
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def quantize_experts_fp8_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights [E, N, K] -> (FP8 [E, N, K], float32 scale [E, N, 1]): each expert's output
    channels quantized as per_token_quant_fp8_ref quantizes rows."""
    q, scale = per_token_quant_fp8_ref(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), scale.view(*w.shape[:2], 1)


def _moe_operand(a: torch.Tensor, quantize: bool) -> torch.Tensor:
    """a as float32 values, through per-token FP8 quantization if `quantize`."""
    if not quantize:
        return a.float()
    return dequantize(*per_token_quant_fp8_ref(a))


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, gate_up_w8a8: bool = True,
                  down_w8a8: bool = True) -> torch.Tensor:
    """Mixture of experts, expert by expert (layouts in kernels/fused_moe.py): each (token, slot)
    row's silu(gate) * up in float32, rounded to x's dtype; its down projection times the routing
    weight, rounded; the slots of a token summed in float32. With FP8 experts (scales given) the
    activations of each GEMM are quantized per token first where its *_w8a8 says so (W8A8), and
    kept as they are otherwise (W8A16)."""
    top_k = topk_ids.shape[1]
    fp8 = w13_scale is not None
    xs = _moe_operand(x, fp8 and gate_up_w8a8)
    slots = torch.zeros(x.shape[0], top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tokens, ks = (topk_ids == e).nonzero(as_tuple=True)
        h = xs[tokens] @ dequantize(w13[e], None if w13_scale is None else w13_scale[e]).t()
        inter = _moe_operand(silu_and_mul_ref(h).to(x.dtype), fp8 and down_w8a8)
        y = inter @ dequantize(w2[e], None if w2_scale is None else w2_scale[e]).t()
        slots[tokens, ks] = (y * topk_weights[tokens, ks, None].float()).to(x.dtype).float()
    return slots.sum(dim=1).to(x.dtype)


def gelu_tanh_and_mul_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_tanh(gate) * up (rounded to x's dtype) quantized per token: (FP8 [T, d],
    scale [T, 1])."""
    out = gelu_tanh_and_mul_ref(x)
    return per_token_quant_fp8_ref(out.reshape(-1, out.shape[-1]))


def lora_delta_ref(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """out [M, N] += ((x @ a.T) per slot * mask) @ b.T in place: a [S * W, K] and b [N, S * W] hold
    S slots' blocks, mask [>= M, S] each row's one-hot slot (all zero for none)."""
    rows, slots = len(x), mask.shape[1]
    h = (x @ a.t()).view(rows, slots, -1) * mask[:rows, :, None]
    return out.addmm_(h.view(rows, -1), b.t())
