"""Schemathesis cases from OpenAI's spec, valid and invalid: never a 5xx, no path or address in errors."""
import asyncio
import threading

import grpc
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.gateway.fake_engine import LEAK, MODEL, FakeEngine, add_fake_engine, serve_live_gateway

EXAMPLES = 40


@pytest.fixture(scope="module")
def gateway_url(tokenizer):
    """The gateway and a fake engine on their own event loop, so that blocking clients can call them."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    found = {}

    async def main() -> None:
        engine = FakeEngine(tokenizer)
        engine.delay = 0
        server = grpc.aio.server()
        await add_fake_engine(server, engine)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        runner, found["url"] = await serve_live_gateway(tokenizer, f"127.0.0.1:{port}")
        ready.set()
        await stop.wait()
        await runner.cleanup()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(40)
    yield found["url"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


@pytest.fixture(scope="module")
def schema(openai_spec):
    return schemathesis.openapi.from_dict(openai_spec)


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.NEGATIVE, schemathesis.GenerationMode.POSITIVE])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_no_server_errors(schema, gateway_url, path, mode):
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
    session = requests.Session()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        if mode is schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
            # A random model name ends at the 404; the served one takes valid cases on to the engine.
            case.body["model"] = MODEL
        response = case.call(base_url=f"{gateway_url}/v1", session=session, timeout=10)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code != 200:
            assert not LEAK.search(response.text), (case.body, response.text)

    check()
