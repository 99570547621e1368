"""--api-key guards every registered route but the allowlist; CORS preflights pass without the key."""
import argparse

import pytest

from pagedserve.gateway.app import build_app
from pagedserve.gateway.cors import CorsRules
from pagedserve.gateway.server import add_gateway_args, api_key, parse_list
from pagedserve.gateway.state import GATEWAY

KEY = "sk-test-123"
OPEN = {"/health", "/ping", "/metrics"}


async def _routes() -> list[tuple[str, str]]:
    """(method, concrete path) of every route the app registers; HEAD mirrors GET."""
    app = build_app(None, "127.0.0.1:1")
    await app[GATEWAY].models[0].engines.close()
    routes = []
    for route in app.router.routes():
        info = route.resource.get_info()
        path = info.get("path") or info["formatter"].format_map({"model": "tiny-model", "response_id": "resp_x"})
        if route.method != "HEAD":
            routes.append((route.method, path))
    return routes


async def test_every_route_is_listed():
    paths = {path for _, path in await _routes()}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/version"} <= paths
    assert OPEN <= paths


def _unauthorized(path: str, body: dict) -> str:
    """The message of a 401 body, checked to be in the shape of the path's protocol."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        return body["error"]["message"]
    if path.startswith("/api/"):
        return body["error"]
    assert body["error"]["code"] == "invalid_api_key"
    return body["error"]["message"]


async def _status(http, method: str, url: str, **headers) -> int:
    async with http.request(method, url, json={}, headers=headers) as r:
        if r.status == 401:
            assert "Authorization: Bearer" in _unauthorized(r.url.path, await r.json())
            assert KEY not in await r.text()
        return r.status


@pytest.mark.parametrize("protect_metrics", [False, True])
async def test_every_route_needs_the_key_except_the_allowlist(serve, http, protect_metrics):
    url = await serve(api_key=KEY, protect_metrics=protect_metrics)
    allowlist = {"/health", "/ping"} if protect_metrics else OPEN
    for method, path in await _routes():
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            status = await _status(http, method, url + path, **headers)
            assert (status != 401) == (path in allowlist), (method, path, headers, status)
        assert await _status(http, method, url + path, Authorization=f"Bearer {KEY}") != 401
        assert await _status(http, method, url + path, Authorization=f"bearer {KEY}") != 401
        for variant in (path + "/", path + "//", "/" + path, path.upper(), path + "%2F"):
            assert await _status(http, method, url + variant) == 401, variant


async def test_unknown_paths_need_the_key_too(serve, http):
    url = await serve(api_key=KEY)
    assert await _status(http, "GET", f"{url}/nowhere") == 401
    assert await _status(http, "GET", f"{url}/nowhere", Authorization=f"Bearer {KEY}") == 404


async def test_sdk_with_the_key(serve):
    import openai

    url = await serve(api_key=KEY)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as good:
        reply = await good.chat.completions.create(model="tiny-model", max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


async def test_without_a_key_any_key_or_none_works(http, base_url):
    for headers in ({}, {"Authorization": "Bearer EMPTY"}):
        async with http.get(f"{base_url}/v1/models", headers=headers) as r:
            assert r.status == 200


PREFLIGHT = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


async def test_cors_preflight_passes_without_the_key_and_without_data(serve, http, engine):
    url = await serve(api_key=KEY, cors=CorsRules(["https://app.example.com"]))
    async with http.options(f"{url}/v1/chat/completions", headers=PREFLIGHT) as r:
        assert r.status == 204 and await r.read() == b""
        assert r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "x-stainless-os" in r.headers["Access-Control-Allow-Headers"]
    assert engine.requests == []
    async with http.options(f"{url}/v1/models", headers={**PREFLIGHT, "Origin": "https://evil.example"}) as r:
        assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
    async with http.options(f"{url}/v1/models", headers={"Origin": "https://app.example.com"}) as r:
        assert r.status == 401


async def test_cors_headers_on_responses_and_streams(serve, http):
    url = await serve(cors=CorsRules(["https://app.example.com"]))
    origin = {"Origin": "https://app.example.com"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=origin) as r:
        assert r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        assert r.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
        await r.read()
    async with http.get(f"{url}/v1/models", headers={"Origin": "https://evil.example"}) as r:
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    wildcard = await serve(cors=CorsRules(["*"]))
    async with http.get(f"{wildcard}/v1/models", headers={"Origin": "https://any.example"}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == "*"


async def test_cors_methods_headers_and_credentials_as_the_flags_say(serve, http):
    origin = "https://app.example.com"
    open_url = await serve(cors=CorsRules(["*"]))
    delete = {**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}
    async with http.options(f"{open_url}/v1/files/f", headers=delete) as r:
        assert r.status == 204 and "DELETE" in r.headers["Access-Control-Allow-Methods"]
        assert "Access-Control-Allow-Credentials" not in r.headers
    strict = await serve(cors=CorsRules([origin], methods=["POST"], headers=["Authorization", "Content-Type"],
                                        credentials=True))
    listed = {**PREFLIGHT, "Access-Control-Request-Headers": "Authorization, content-type"}
    async with http.options(f"{strict}/v1/chat/completions", headers=listed) as r:
        assert r.status == 204 and r.headers["Access-Control-Allow-Methods"] == "POST"
        assert r.headers["Access-Control-Allow-Credentials"] == "true"
    async with http.options(f"{strict}/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"}) as r:
        assert r.status == 403 and "--allowed-methods" in (await r.json())["error"]["message"]
    async with http.options(f"{strict}/v1/chat/completions", headers=PREFLIGHT) as r:
        assert r.status == 403 and "'x-stainless-os'" in (await r.json())["error"]["message"]
    credentialed = await serve(cors=CorsRules(["*"], credentials=True))
    async with http.get(f"{credentialed}/v1/models", headers={"Origin": origin}) as r:
        # Browsers refuse "*" with credentials.
        assert r.headers["Access-Control-Allow-Origin"] == origin
        assert r.headers["Access-Control-Allow-Credentials"] == "true"


async def test_without_allowed_origins_no_cors(http, base_url):
    async with http.options(f"{base_url}/v1/models", headers=PREFLIGHT) as r:
        assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers


def test_flags(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    args = parser.parse_args(["--allowed-origins", "https://a.example, https://b.example"])
    assert api_key(args) == "from-env" and not args.protect_metrics
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert parse_list('["*"]') == ["*"]
    assert (args.allowed_methods, args.allowed_headers, args.allow_credentials) == (["*"], ["*"], False)
    strict = parser.parse_args(["--allowed-methods", "GET,POST", "--allowed-headers", '["authorization"]',
                                "--allow-credentials"])
    assert (strict.allowed_methods, strict.allowed_headers, strict.allow_credentials) == (
        ["GET", "POST"], ["authorization"], True)
    assert api_key(parser.parse_args(["--api-key", "k", "--protect-metrics"])) == "k"


async def test_the_key_as_x_api_key_as_anthropic_clients_send_it(serve, http):
    url = await serve(api_key=KEY)
    assert await _status(http, "GET", f"{url}/v1/models", **{"x-api-key": KEY}) == 200
    for wrong in ("", "wrong", f"Bearer {KEY}", KEY + "x"):
        assert await _status(http, "GET", f"{url}/v1/models", **{"x-api-key": wrong}) == 401
