import importlib.util
from pathlib import Path

import pytest

from pagedserve.bench import workload

SHARED = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.py"


def test_mixed_totals_for_seed_0():
    w = workload.mixed()
    assert len(w.prompts) == 512
    assert (w.prompt_tokens, w.output_tokens) == (300_975, 148_936)
    assert all(128 <= len(p) <= 1024 for p in w.prompts)
    assert all(100 <= t < 32000 for p in w.prompts for t in p)


def test_random_has_fixed_lengths():
    w = workload.random(n=3, input_len=5, output_len=7, vocab=200)
    assert [len(p) for p in w.prompts] == [5, 5, 5] and w.output_lens == [7, 7, 7]


def test_same_requests_as_the_shared_definition():
    if not SHARED.exists():
        pytest.skip(f"the shared workload definition is not at {SHARED} (only in the project checkout)")
    spec = importlib.util.spec_from_file_location("shared_workload", SHARED)
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)
    for kwargs in ({}, {"n": 20, "seed": 3, "vocab": 500}):
        prompts, outs = shared.mixed(**kwargs)
        ours = workload.mixed(**kwargs)
        assert ours.prompts == prompts and ours.output_lens == outs
