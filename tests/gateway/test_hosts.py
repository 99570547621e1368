"""SEC-15: a gateway on a loopback address answers loopback Host names only (and --allowed-hosts);
any other gets a 421 in OpenAI's error shape, so that a web page cannot drive it by DNS rebinding."""
import pytest

from tests.gateway.test_server import gateway_process


@pytest.mark.parametrize("host, status", [("evil.example", 421), ("evil.example:8000", 421),
                                          ("127.0.0.1.evil.example", 421), ("127.0.0.1:8000", 200),
                                          ("localhost:8000", 200), ("LOCALHOST", 200), ("[::1]:8000", 200),
                                          ("my.example:443", 200)])
async def test_only_loopback_and_allowed_hosts_are_answered(http, serve, host, status):
    from pagedserve.gateway.hosts import allowed_hosts
    url = await serve(allowed_hosts=allowed_hosts("127.0.0.1", ["my.example"]))
    async with http.get(f"{url}/v1/models", headers={"Host": host}) as r:
        assert r.status == status
        if status == 421:
            error = (await r.json())["error"]
            assert error["code"] == "misdirected_request" and "--allowed-hosts" in error["message"]


async def test_the_gateway_command_checks_hosts_on_loopback(http, engine, tokenizer_dir):
    async with gateway_process(http, engine, tokenizer_dir) as (url, _):
        async with http.get(f"{url}/health", headers={"Host": "evil.example"}) as r:
            assert r.status == 421
        async with http.get(f"{url}/health") as r:
            assert r.status == 200


def test_which_hosts_each_address_answers():
    from pagedserve.gateway.hosts import allowed_hosts, is_loopback
    assert allowed_hosts("0.0.0.0", []) is None and allowed_hosts("::", ["*"]) is None
    assert allowed_hosts("0.0.0.0", ["A.example:80"]) == {"a.example"}
    assert allowed_hosts("127.0.0.1", ["*"]) is None
    assert allowed_hosts("127.0.0.2", []) == {"localhost", "127.0.0.1", "[::1]", "127.0.0.2"}
    assert "[::1]" in allowed_hosts("::1", [])
    # A Unix socket (--uds): no web page can reach it, so DNS rebinding cannot either.
    assert allowed_hosts(None, []) is None and allowed_hosts(None, ["a.example"]) == {"a.example"}
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.1", "example.com")] == \
        [True, True, True, False, False, False]
