import json

from pagedserve.bench import pooling

TINY = json.dumps({"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                   "vocab_size": 500})


def test_the_pooling_bench_runs_at_a_tiny_size(capsys):
    pooling.main(["--num-inputs", "12", "--num-docs", "6", "--max-len", "64", "--shape-overrides", TINY])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["bench"], r["inputs"]) for r in lines] == [("pooling-embed", 12), ("pooling-rerank", 6)]
    assert all(r["tokens_per_s"] > 0 and r["gemm_roofline_share"] >= 0 for r in lines)
    # Each rerank pair is the 32-token query and a document of 32 to 64 tokens.
    assert 6 * 64 <= lines[1]["tokens"] <= 6 * 96
