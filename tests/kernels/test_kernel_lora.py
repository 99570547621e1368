import pytest
import torch

from tests.kernels.kernel_testing import DEVICE
from pagedserve.kernels.lora import add_lora, tiling
from pagedserve.kernels.reference import lora_delta_ref


def case(rows: int, k: int, n: int, num_slots: int, width: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    a = (torch.randn(num_slots * width, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, num_slots * width, generator=g).to(dtype)
    out = torch.randn(rows, n, generator=g).to(dtype)
    # Padding rows past the step's tokens hold -1, as LoraSlots.upload leaves them.
    slots = torch.randint(-1, num_slots, (rows + 7,), generator=g)
    slots[rows:] = -1
    return [t.to(DEVICE) for t in (x, a, b, out, slots)]


def reference(out, x, a, b, slots, num_slots):
    mask = (slots[:, None] == torch.arange(num_slots, device=slots.device)).double()
    return lora_delta_ref(out.double(), x.double(), a.double(), b.double(), mask)


@pytest.mark.parametrize("rows, k, n, num_slots, width", [
    (1, 256, 96, 1, 16),        # one decode row
    (16, 4096 // 8, 384, 1, 48),  # a decode graph's rows, qkv's three shards of rank 16
    (29, 700, 130, 3, 8),       # ragged everything, three slots
    (200, 384, 64, 2, 32),      # a prompt chunk: row blocks of 64, fewer K slices
])
def test_add_lora_matches_the_reference_in_float32(rows, k, n, num_slots, width) -> None:
    x, a, b, out, slots = case(rows, k, n, num_slots, width, torch.float32)
    want = reference(out, x, a, b, slots, num_slots)
    got = add_lora(out, x, a, b, slots, num_slots)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_add_lora_in_bfloat16_is_within_its_rounding() -> None:
    x, a, b, out, slots = case(24, 512, 256, 2, 16, torch.bfloat16, seed=1)
    want = reference(out, x, a, b, slots, 2)
    got = add_lora(out.clone(), x, a, b, slots, 2).double()
    # The output's rounding, and the delta's bf16 input to B (as cuBLAS's bf16 product has it).
    assert ((got - want).abs() <= 2 ** -7 * want.abs() + 0.05).all()


def test_rows_without_an_adapter_are_left_bit_for_bit() -> None:
    x, a, b, out, slots = case(40, 256, 200, 2, 16, torch.float32, seed=2)
    slots[:20] = -1
    slots[20:40] = 1
    before = out.clone()
    add_lora(out, x, a, b, slots, 2)
    assert torch.equal(out[:20], before[:20])
    assert not torch.equal(out[20:], before[20:])


def test_a_strided_input_of_a_padded_buffer() -> None:
    x, a, b, out, slots = case(32, 300, 80, 1, 16, torch.float32, seed=3)
    wide = torch.zeros(32, 320, device=DEVICE)
    wide[:, :300] = x
    want = reference(out, x, a, b, slots, 1)
    torch.testing.assert_close(add_lora(out, wide[:, :300], a, b, slots, 1).double(), want, rtol=1e-5, atol=1e-4)


def test_blocks_of_rows_that_use_some_slots_only() -> None:
    # Row blocks of 64: the first uses slot 2 alone, the second slot 0 and the base model.
    x, a, b, out, slots = case(80, 320, 150, 3, 24, torch.float32, seed=4)
    slots[:64] = 2
    slots[64:72] = 0
    slots[72:] = -1
    want = reference(out, x, a, b, slots, 3)
    torch.testing.assert_close(add_lora(out, x, a, b, slots, 3).double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("width", [16, 48, 96, 192, 384])
@pytest.mark.parametrize("rows", [1, 16, 64, 2048])
def test_tilings_fit_shared_memory_and_cover_k(rows: int, width: int) -> None:
    t = tiling(rows, 14336, width)
    # Three stages of bf16 x and a_s tiles within an H100's 227 KB (256 columns at 64 x 128 overran it).
    assert 3 * 2 * (t.block_m * t.block_k + t.block_k * t.width_pad) <= 227 * 1024
    assert t.width_pad >= width and t.k_per_split % t.block_k == 0
    assert t.block_m * t.width_pad <= 8192
