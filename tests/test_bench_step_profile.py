"""`bench latency --profile`'s arithmetic on a made-up kernel timeline (the profiler itself needs
a CUDA GPU)."""
import pytest

from pagedserve.bench.step_profile import Kernel, decode_medians, kind, split_steps, summarize


def step(start: float, gemm_us: float) -> list[Kernel]:
    """A step: a norm, a GEMM 1 us after it, attention overlapping the GEMM's last 0.5 us, then
    the sampling kernels."""
    return [Kernel("_rms_norm_kernel", start, start + 2),
            Kernel("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", start + 3, start + 3 + gemm_us),
            Kernel("_attention_kernel", start + 2.5 + gemm_us, start + 10 + gemm_us),
            Kernel("_chunk_argmax_kernel", start + 10 + gemm_us, start + 11 + gemm_us),
            Kernel("_reduce_argmax_kernel", start + 11 + gemm_us, start + 12 + gemm_us)]


def test_kinds() -> None:
    assert kind("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16>") == "gemm"
    assert kind("_merge_kernel") == "attention merge"
    assert kind("_rotary_write_kv_kernel") == "rotary + kv write"
    assert kind("void at::native::elementwise_kernel") == "other"


def test_decode_steps_are_cut_at_the_sampling_and_summed_by_kind() -> None:
    # A prefill, then 6 decode steps whose GEMMs take 10, 11, ... 15 us, shuffled as a trace may be.
    kernels = step(0, 500) + [k for i in range(6) for k in step(1000 + 100 * i, 10 + i)]
    steps = split_steps(reversed(kernels))
    assert [len(s) for s in steps] == [5] * 7
    assert summarize(steps[1]) == {"span": 22.0, "gaps": 1.0, "overlap": 0.5, "kernels": 5.0,
                                   "rms norm": 2.0, "gemm": 10.0, "attention": 7.5, "sampling": 2.0}
    # The decode steps but the first and last two: GEMMs of 12 and 13 us.
    medians = decode_medians(steps)
    assert medians["gemm"] == 12.5 and medians["span"] == 24.5


def test_too_short_a_run_says_what_to_raise() -> None:
    with pytest.raises(ValueError, match="raise --output-len"):
        decode_medians(split_steps(step(0, 5) + step(100, 5)))
