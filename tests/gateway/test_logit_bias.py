"""SEC-5, the gateway's side: logit_bias has at most MAX_LOGIT_BIAS_TOKENS entries, and a request's
parameters are converted to their wire form once, not once per choice."""
import time

from pagedserve.common.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams
from pagedserve.gateway import generation, params

COMPLETIONS = "/v1/completions"


async def test_a_bias_past_the_cap_is_a_400(http, base_url, engine):
    bias = {str(t): 1 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)}
    async with http.post(base_url + COMPLETIONS, json={"prompt": "hi", "logit_bias": bias}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == "logit_bias" and f"limit is {MAX_LOGIT_BIAS_TOKENS}" in error["message"]
    assert engine.requests == []


async def test_a_bias_is_converted_once_for_all_choices(http, base_url, engine, monkeypatch):
    converted = []
    to_proto = generation.sampling_to_proto
    monkeypatch.setattr(generation, "sampling_to_proto", lambda p: converted.append(p) or to_proto(p))
    # The tiny vocabulary's every token (fewer than the cap).
    bias = {str(t): 5 for t in range(engine.vocab_size)}
    body = {"prompt": "hi", "n": 16, "max_tokens": 1, "seed": 7, "logit_bias": bias}
    async with http.post(base_url + COMPLETIONS, json=body) as r:
        assert r.status == 200 and len((await r.json())["choices"]) == 16
    assert len(converted) == 1
    assert all(dict(q.params.logit_bias) == {int(t): 5.0 for t in bias} for q in engine.requests)
    assert sorted(q.params.seed for q in engine.requests) == list(range(7, 23))


def test_fanning_out_a_capped_bias_takes_little_cpu():
    """64 prompts x n=16 at the cap (1024 engine requests): the review's bar is 50 ms of gateway
    CPU for n=16 alone; the whole fan-out takes about 2 ms here, where a SamplingParams and a wire
    conversion per choice (each clamping and copying the map again) took 0.42 s."""
    sampling = SamplingParams(n=16, seed=1, logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS_TOKENS)})
    started = time.process_time()
    choices = generation.fan_out("r", [[1, 2, 3]] * 64, sampling)
    elapsed = time.process_time() - started
    assert len(choices) == 1024 and len(choices[-1].wire.logit_bias) == MAX_LOGIT_BIAS_TOKENS
    assert elapsed < 0.05, f"{elapsed:.3f} s"
