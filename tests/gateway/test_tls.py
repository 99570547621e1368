"""HTTPS on the REST API (--ssl-*): served with the certificate, refused in plain HTTP, client
certificates checked when asked for, and bad flags refused in one line."""
import argparse
import ssl

import aiohttp
import pytest

from pagedserve.gateway import tls
from pagedserve.gateway.app import build_app
from pagedserve.gateway.server import start


def flags(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tls.add_tls_args(parser)
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in given.items()]
    return parser.parse_args(argv)


def client_context(pki, cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert is not None:
        context.load_cert_chain(pki / f"{cert}.pem", pki / f"{cert}.key")
    return context


@pytest.fixture
async def https_gateway(engine, tokenizer):
    """Starts a gateway with the given --ssl-* flags; returns its port."""
    runners = []

    async def start_one(args: argparse.Namespace) -> int:
        runner = await start(build_app(tokenizer, engine.address), "127.0.0.1", 0,
                             ssl_context=tls.server_context(args))
        runners.append(runner)
        return runner.addresses[0][1]

    yield start_one
    for runner in runners:
        await runner.cleanup()


async def test_https_serves_the_api_and_plain_http_gets_nothing(pki, https_gateway, http):
    port = await https_gateway(flags(ssl_certfile=pki / "service.pem", ssl_keyfile=pki / "service.key"))
    async with http.get(f"https://localhost:{port}/v1/models", ssl=client_context(pki)) as reply:
        assert reply.status == 200 and (await reply.json())["object"] == "list"
    with pytest.raises(aiohttp.ClientError):
        async with http.get(f"http://localhost:{port}/health") as reply:
            await reply.read()


@pytest.mark.parametrize("reqs, admitted", [(1, {None, "service"}), (2, {"service"})])
async def test_client_certificates_are_checked_when_asked_for(pki, https_gateway, http, reqs, admitted):
    port = await https_gateway(flags(ssl_certfile=pki / "service.pem", ssl_keyfile=pki / "service.key",
                                     ssl_ca_certs=pki / "ca.pem", ssl_cert_reqs=reqs))
    for cert in (None, "service", "stranger"):
        try:
            async with http.get(f"https://localhost:{port}/health", ssl=client_context(pki, cert)) as reply:
                got_in = reply.status == 200
        except aiohttp.ClientError:
            got_in = False
        assert got_in == (cert in admitted), (reqs, cert)


@pytest.mark.parametrize("given, says", [
    (dict(ssl_keyfile="k.pem"), "need --ssl-certfile"),
    (dict(ssl_certfile="c.pem"), "--ssl-certfile needs --ssl-keyfile"),
    (dict(ssl_certfile="c.pem", ssl_keyfile="k.pem", ssl_cert_reqs=2), "against --ssl-ca-certs; give it"),
    (dict(ssl_certfile="/none/c.pem", ssl_keyfile="/none/k.pem"), "does not load"),
])
def test_flags_that_do_not_go_together_or_load_are_refused_in_one_line(given, says):
    with pytest.raises(ValueError) as refused:
        tls.server_context(flags(**given))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_no_flags_no_tls():
    assert tls.server_context(flags()) is None and tls.argv(flags()) == []
