"""Gateway fixtures: the tiny tokenizer, the fake Engine on grpc.aio, gateways on loopback, clients."""
import aiohttp
import grpc
import openai
import pytest
import yaml

from pagedserve.common.tokenizer import Tokenizer
from tests.gateway.fake_engine import (SPEC, SPEC_NAME, FakeEngine, add_fake_engine, build_tiny_tokenizer,
                                       serve_gateway, serve_live_gateway)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture
async def engine(tokenizer):
    fake = FakeEngine(tokenizer)
    server = grpc.aio.server()
    await add_fake_engine(server, fake)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake.address = f"127.0.0.1:{port}"
    yield fake
    await server.stop(0)


@pytest.fixture
async def serve(engine, tokenizer):
    """Starts gateways on the fake engine with build_app's options; returns their base URLs."""
    runners = []

    async def start_one(**options) -> str:
        runner, url = await serve_live_gateway(tokenizer, engine.address, **options)
        runners.append(runner)
        return url

    yield start_one
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def base_url(engine, tokenizer):
    runner, url = await serve_live_gateway(tokenizer, engine.address)
    yield url
    await runner.cleanup()


@pytest.fixture
async def dead_engine_url(tokenizer, unused_tcp_port):
    runner, url = await serve_gateway(tokenizer, f"127.0.0.1:{unused_tcp_port}")
    yield url
    await runner.cleanup()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def client(base_url):
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0,
                                  _strict_response_validation=True) as c:
        yield c


@pytest.fixture
async def loose_client(base_url):
    # The SDK types a completions choice's finish_reason as non-null, which every stream chunk but the
    # last contradicts (OpenAI and vLLM send null there), so completion streams are not validated.
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def openai_spec() -> dict:
    """OpenAI's OpenAPI description (read-only: copy before changing it)."""
    if SPEC is None:
        pytest.skip(f"{SPEC_NAME} not found in any parent directory of the tests; the OpenAI spec "
                    "checks need it (see shared/specs/README.md)")
    return yaml.load(SPEC.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@pytest.fixture
def embedder(engine):
    """The fake engine as a pooling engine that embeds (8 components, Matryoshka sizes 2 and 4)."""
    engine.runner = "pooling"
    engine.pooling = dict(pooling_tasks=["embed"], embedding_size=8, matryoshka_dimensions=[2, 4])
    return engine


@pytest.fixture
def reranker(engine):
    """The fake engine as a pooling engine with a one-label classifier (a cross-encoder)."""
    engine.runner = "pooling"
    engine.pooling = dict(pooling_tasks=["classify"], embedding_size=8, num_labels=1)
    return engine
