"""Routing tokens to experts: the top-k experts of each token from its router logits, and the
alignment of the chosen (token, expert) pairs into blocks of one expert each, which the grouped
GEMMs of fused_moe read.

A token's k choices are its slots: slot t * top_k + j is token t's j-th expert. `moe_align` sorts
the slots by expert and pads each expert's run to a multiple of block_m with the marker
num_slots (= T * top_k), so that each block of block_m entries belongs to one expert; an expert
with no slot gets no block. Both run on the device without reading anything back to the host,
into buffers whose sizes follow from T, top_k and the expert count, so a decode step that calls
them can be captured in a CUDA graph.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl

# Slots a chunk of the alignment reads at a time.
CHUNK = 1024
# Up to this many slots the one alignment program also places them (a decode step: one launch);
# past it a second launch places them with a program per chunk.
SINGLE_PROGRAM_SLOTS = 2048
# Blocks whose expert one loop step of the alignment finds.
BLOCK_CHUNK = 128


@triton.jit
def _route_kernel(logits, weights, ids, num_experts, stride_l, TOP_K: tl.constexpr,
                  TOP_K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    real = offs < num_experts
    x = tl.load(logits + row * stride_l + offs, mask=real, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    # Below every probability, so padding lanes and picked experts are never picked (again).
    p = tl.where(real, p / tl.sum(p, 0), -1.0)
    slot = tl.arange(0, TOP_K_PAD)
    top_w = tl.zeros([TOP_K_PAD], tl.float32)
    top_i = tl.zeros([TOP_K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        i = tl.argmax(p, 0)
        top_w = tl.where(slot == j, tl.max(p, 0), top_w)
        top_i = tl.where(slot == j, i, top_i)
        p = tl.where(offs == i, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights + row * TOP_K + slot, top_w, mask=slot < TOP_K)
    tl.store(ids + row * TOP_K + slot, top_i, mask=slot < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, top_k], topk_ids int32 [T, top_k]):
    the softmax over all experts (in float32), its top_k largest in descending order (ties to
    the lower expert id), divided by their sum if `renormalize`, as `route_ref`. Qwen3-MoE
    (norm_topk_prob true) and Mixtral (a softmax over the top-k logits, the same numbers)
    renormalize; Qwen2-MoE (norm_topk_prob false) does not. One launch, one program a token."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens > 0:
        block_e = triton.next_power_of_2(num_experts)
        # One warp keeps the reductions in a warp for the expert counts of today's models.
        _route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            TOP_K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_E=block_e,
            num_warps=1 if block_e <= 256 else 4, **pdl.launch_args(router_logits.device))
    return weights, ids


@dataclass(slots=True)
class MoeAlignment:
    """Slots sorted by expert in blocks of block_m, as `moe_align` returns them.

    sorted_ids int32 [num_slots + E * (block_m - 1)]: slot numbers, each expert's run padded with
    num_slots to a multiple of block_m; entries from num_padded on are unwritten. expert_ids
    int32 [cdiv(len(sorted_ids), block_m)]: the expert of each block below num_padded.
    num_padded int32 [1]: the padded length, a multiple of block_m."""
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_slots: int

    @property
    def max_blocks(self) -> int:
        """A host-known bound on the blocks below num_padded: every block holds a slot."""
        return min(triton.cdiv(self.sorted_ids.numel(), self.block_m), self.num_slots)


@triton.jit
def _place(topk_ids, sorted_ids, cursor, start, num_slots, CHUNK: tl.constexpr):
    # The order of an expert's slots is the order the atomics land in: any order gives each row
    # of a GEMM the same bits, since a row's products do not depend on its neighbours.
    offs = start + tl.arange(0, CHUNK)
    real = offs < num_slots
    expert = tl.load(topk_ids + offs, mask=real, other=0)
    pos = tl.atomic_add(cursor + expert, 1, mask=real, sem="relaxed")
    tl.store(sorted_ids + pos, offs, mask=real)


@triton.jit(do_not_specialize=["num_slots"])
def _align_kernel(topk_ids, sorted_ids, expert_ids, num_padded, cursor, num_slots, num_experts,
                  BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_CHUNK: tl.constexpr, PLACE: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    # Slots past the end count in the spare bin num_experts, dropped below.
    counts = tl.zeros([NUM_BINS], tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert = tl.load(topk_ids + offs, mask=offs < num_slots, other=num_experts)
        counts += tl.histogram(expert.to(tl.int32), NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_padded, total)
    # Through the atomics unit, as the placing atomics that read it after the barrier.
    tl.atomic_xchg(cursor + bins, starts)
    lane = tl.arange(0, BLOCK_M)
    tl.store(sorted_ids + (starts + counts)[:, None] + lane[None, :], num_slots,
             mask=lane[None, :] < (padded - counts)[:, None])
    for first in range(0, total // BLOCK_M, BLOCK_CHUNK):
        block = first + tl.arange(0, BLOCK_CHUNK)
        # A block belongs to the expert whose run it starts in: count the runs that end before.
        owner = tl.sum((ends[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(expert_ids + block, owner, mask=block * BLOCK_M < total)
    if PLACE:
        tl.debug_barrier()
        for start in range(0, num_slots, CHUNK):
            _place(topk_ids, sorted_ids, cursor, start, num_slots, CHUNK)


@triton.jit(do_not_specialize=["num_slots"])
def _place_kernel(topk_ids, sorted_ids, cursor, num_slots, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    _place(topk_ids, sorted_ids, cursor, tl.program_id(0) * CHUNK, num_slots, CHUNK)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, top_k] (int32 or int64, contiguous) -> its slots sorted by expert in blocks
    of block_m (see MoeAlignment). One launch up to SINGLE_PROGRAM_SLOTS slots, two past it."""
    num_slots = topk_ids.numel()
    device = topk_ids.device
    max_padded = num_slots + num_experts * (block_m - 1)
    num_bins = triton.next_power_of_2(num_experts + 1)
    out = MoeAlignment(torch.empty(max_padded, dtype=torch.int32, device=device),
                       torch.empty(triton.cdiv(max_padded, block_m), dtype=torch.int32, device=device),
                       torch.empty(1, dtype=torch.int32, device=device), block_m, num_slots)
    cursor = torch.empty(num_bins, dtype=torch.int32, device=device)
    single = num_slots <= SINGLE_PROGRAM_SLOTS
    launch = pdl.launch_args(device)
    _align_kernel[(1,)](topk_ids, out.sorted_ids, out.expert_ids, out.num_padded, cursor, num_slots,
                        num_experts, BLOCK_M=block_m, NUM_BINS=num_bins, CHUNK=CHUNK,
                        BLOCK_CHUNK=BLOCK_CHUNK, PLACE=single, num_warps=8, **launch)
    if not single:
        _place_kernel[(triton.cdiv(num_slots, CHUNK),)](topk_ids, out.sorted_ids, cursor, num_slots,
                                                         CHUNK=CHUNK, num_warps=8, **launch)
    return out
