"""pagedserve:http_requests_total counts answered requests by route template, method and status class."""
import re

import pytest


async def _metrics(http, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


def _count(text: str, handler: str, method: str, status: str) -> float:
    found = re.search(rf'^pagedserve:http_requests_total\{{handler="{re.escape(handler)}",method="{method}",'
                      rf'status="{status}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("method, path, body, handler, status", [
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}, "/v1/responses", "2xx"),
    ("POST", "/v1/responses", {"input": []}, "/v1/responses", "4xx"),
    ("GET", "/v1/responses/resp_none", None, "/v1/responses/{response_id}", "4xx"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     "/v1/chat/completions", "2xx"),
    ("GET", "/nowhere", None, "unmatched", "4xx"),
])
async def test_requests_are_counted_by_route_and_status(http, base_url, method, path, body, handler, status):
    before = _count(await _metrics(http, base_url), handler, method, status)
    async with http.request(method, base_url + path, json=body) as r:
        assert f"{r.status // 100}xx" == status
    assert _count(await _metrics(http, base_url), handler, method, status) == before + 1
