"""Valid /v1/messages and Ollama bodies with random JSON in their fields: never a 5xx, always the
protocol's error shape, no path or address in errors."""
import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.gateway.fake_engine import LEAK, MODEL
from tests.gateway.test_fuzz import gateway_url  # noqa: F401 (the fixture)

EXAMPLES = 60
USER = [{"role": "user", "content": "hi"}]
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                           max_size=3), max_leaves=8)
# Each route: a body it serves, the fields to fill with random JSON, and whether an error has its shape.
ROUTES = {
    "/v1/messages": ({"model": MODEL, "max_tokens": 4, "messages": USER},
                     ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "stream",
                      "temperature", "top_p", "top_k", "thinking", "output_config", "metadata"],
                     lambda e: e["type"] == "error" and set(e["error"]) == {"type", "message"}),
    "/v1/messages/count_tokens": ({"model": MODEL, "messages": USER}, ["messages", "system", "tools", "thinking"],
                                  lambda e: e["type"] == "error"),
    "/api/chat": ({"model": MODEL, "messages": USER, "stream": False, "options": {"num_predict": 4}},
                  ["model", "messages", "tools", "format", "options", "stream", "think", "logprobs", "top_logprobs"],
                  lambda e: list(e) == ["error"] and isinstance(e["error"], str)),
    "/api/generate": ({"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
                      ["prompt", "system", "raw", "suffix", "format", "options", "think", "context", "logprobs"],
                      lambda e: list(e) == ["error"] and isinstance(e["error"], str)),
}


@pytest.mark.parametrize("path", ROUTES)
def test_random_fields_never_crash(gateway_url, path):  # noqa: F811
    base, fields, shaped = ROUTES[path]
    session = requests.Session()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(changes=st.dictionaries(st.sampled_from(fields), JSON, min_size=1, max_size=3),
           block=st.dictionaries(st.sampled_from(["type", "text", "id", "input", "content", "tool_use_id", "role"]),
                                 JSON, max_size=4))
    def check(changes, block):
        body = base | changes
        if changes.keys() == {"messages"}:
            body["messages"] = [{"role": "user", "content": [block]}]
        response = session.post(gateway_url + path, json=body, timeout=10)
        assert response.status_code < 500, (body, response.text)
        if response.status_code != 200:
            assert shaped(response.json()) and not LEAK.search(response.text), (body, response.text)

    check()
