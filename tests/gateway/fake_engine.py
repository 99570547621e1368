"""What the gateway tests run against: a tiny byte-level BPE tokenizer, a fake Engine service on
grpc.aio, and the gateway on loopback."""
import asyncio
import json
import math
import re
import time
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pagedserve.common.sampling_params import MAX_LOGPROBS
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.app import build_app
from pagedserve.gateway.server import start
from pagedserve.v1 import engine_pb2 as pb
from pagedserve.v1 import engine_pb2_grpc
from tests.serving import wait_health

# Outside the repository (../shared/specs), so looked up in every parent of this file.
SPEC_NAME = Path("shared", "specs", "openai-openapi.yaml")
SPEC = next((p / SPEC_NAME for p in Path(__file__).resolve().parents if (p / SPEC_NAME).is_file()), None)
MODEL = "tiny-model"
MAX_MODEL_LEN = 256
CACHED_TOKENS = 3
REPLY = "Hello wörld 😀 and 🎉! The quick brown fox jumps over the lazy dog. "
# What error messages must never carry: tracebacks, source or socket paths, addresses.
LEAK = re.compile(r"Traceback|File \"|\.py\b|/(home|work|tmp|usr|opt|root|srv|var)/|unix:|ipv[46]:|localhost"
                  r"|\b\d{1,3}(\.\d{1,3}){3}\b|\[::1?\]")
# What the fake scheduler reports about itself in ModelInfo.
ENGINE_STATS = dict(block_size=16, num_blocks=100, num_free_blocks=75, num_running=2, num_waiting=1,
                    num_background_running=1, num_background_waiting=1, num_preemptions=4, kv_cache_usage=0.25,
                    prefix_cache_queries=90, prefix_cache_hits=30, enable_prefix_caching=True,
                    gpu_memory_utilization=0.9, cache_dtype="fp8")
# Its step histograms: per-bucket counts, the last bucket being +Inf.
ENGINE_STEPS = dict(
    step_schedule=pb.StepHistogram(bucket_upper_bounds_s=[1e-4, 1e-3], bucket_counts=[3, 2, 0], count=5,
                                   sum_s=0.0012),
    step_forward=pb.StepHistogram(bucket_upper_bounds_s=[1e-3, 1e-2], bucket_counts=[0, 4, 1], count=5,
                                  sum_s=0.05),
    step_idle=pb.StepHistogram(bucket_upper_bounds_s=[1e-4, 1e-3], bucket_counts=[2, 1, 1], count=4,
                               sum_s=0.0021))
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "A user asks and the assistant answers politely.",
    "Grüße aus München, héllo wörld, ça va très bien.",
    "日本語のテキストも少しだけ。",
    "Party time 🎉 smile 😀",
] * 20


def build_tiny_tokenizer(path, vocab_size: int = 300) -> None:
    """Byte-level BPE small enough that an emoji takes several tokens."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>",
              "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def fake_logprobs(i: int, token: int, k: int, vocab_size: int) -> pb.TokenLogprobs:
    """Output token i is the most likely, at logprob -0.01 * (i + 1); the k top tokens are it and
    the ids after it, each one less likely (logprob one lower) than the one before."""
    logprob = -0.01 * (i + 1)
    return pb.TokenLogprobs(logprob=logprob, rank=1,
                            top_token_ids=[(token + j) % vocab_size for j in range(k)],
                            top_logprobs=[logprob - j for j in range(k)])


def fake_pooled(request: pb.PoolRequest, embedding_size: int, num_labels: int = 1) -> list[float]:
    """The fake engine's pooled data. embed: component j sums sin((t + 1) * (j + 1) + type) over the
    tokens t, cut to `dimensions` and then normalized unless normalize is false; classify: logit j
    is ((sum of ids + 5j) mod 17 - 8) / 4, through a sigmoid (one label) or a softmax unless
    activation is false."""
    p = request.params
    ids, types = request.prompt_token_ids, list(request.token_type_ids) or [0] * len(request.prompt_token_ids)
    if p.task == "classify":
        logits = [((sum(ids) + 5 * j) % 17 - 8) / 4 for j in range(num_labels)]
        if p.HasField("activation") and not p.activation:
            return logits
        if num_labels == 1:
            return [1 / (1 + math.exp(-logits[0]))]
        total = sum(math.exp(x) for x in logits)
        return [math.exp(x) / total for x in logits]
    vector = [sum(math.sin((t + 1) * (j + 1) + k) for t, k in zip(ids, types)) for j in range(embedding_size)]
    vector = vector[:p.dimensions or None]
    if p.HasField("normalize") and not p.normalize:
        return vector
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def embedded(ids: list[int], size: int = 8, **params) -> list[float]:
    """fake_pooled's embedding of `ids`; `params` are PoolingParams fields."""
    return fake_pooled(pb.PoolRequest(prompt_token_ids=ids, params=pb.PoolingParams(task="embed", **params)), size)


def classified(ids: list[int]) -> float:
    """fake_pooled's score of `ids` as a one-label classifier."""
    return fake_pooled(pb.PoolRequest(prompt_token_ids=ids, params=pb.PoolingParams(task="classify")), 0)[0]


class Refused(Exception):
    """Ends a fake request with a gRPC status, as the scheduler would."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details


class FakeEngine(engine_pb2_grpc.EngineServicer):
    """Replies with REPLY's tokens (or `reply`'s), `tokens_per_reply` per message after `delay`
    seconds, cycling until max_tokens; with logprobs asked, fake_logprobs of each."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.reply = tokenizer.encode(REPLY, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id
        self.vocab_size = tokenizer.vocab_size
        self.delay = 0.001
        self.tokens_per_reply = 1
        self.max_model_len = MAX_MODEL_LEN
        self.max_logprobs = MAX_LOGPROBS
        # The LoRA adapters it reports serving, and ModelInfo's LoRA fields (max_loras, running and
        # waiting adapters).
        self.lora_names: list[str] = []
        self.lora_info: dict = {}
        self.fail_after: int | None = None
        self.reject: grpc.StatusCode | None = None
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []
        self.cancelled: dict[str, float] = {}
        self.stream_calls = 0
        self.info_calls = 0
        self.address = ""
        self.model = MODEL
        self.steps = ENGINE_STEPS
        # What ModelInfo says of the runner; a pooling engine answers Pool with fake_pooled.
        self.runner = "generate"
        self.pooling = dict(pooling_tasks=[], embedding_size=8)
        self.pool_requests: list[pb.PoolRequest] = []

    async def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        try:
            async for response in self._replies(request):
                yield response
        except Refused as e:
            await context.abort(e.code, e.details)

    async def GenerateStream(self, request_iterator, context):
        """Each request runs as Generate would, its responses and failure sent as the call's outputs."""
        self.stream_calls += 1
        outputs: asyncio.Queue = asyncio.Queue()
        running: dict[str, asyncio.Task] = {}

        async def run(request):
            try:
                async for response in self._replies(request):
                    outputs.put_nowait(pb.StreamOutput(request_id=request.request_id, response=response))
            except Refused as e:
                outputs.put_nowait(pb.StreamOutput(request_id=request.request_id, error_code=e.code.value[0],
                                                   error_message=e.details))

        async def read():
            async for message in request_iterator:
                if message.HasField("abort"):
                    task = running.pop(message.abort.request_id, None)
                    if task is not None:
                        task.cancel()
                    continue
                self.metadata.append({"x-request-id": message.trace_id})
                running[message.generate.request_id] = asyncio.create_task(run(message.generate))

        reading = asyncio.create_task(read())
        try:
            while True:
                yield pb.StreamResponse(outputs=[await outputs.get()])
        finally:
            reading.cancel()
            for task in running.values():
                task.cancel()

    async def _replies(self, request):
        self.requests.append(request)
        if self.reject is not None:
            raise Refused(self.reject, "rejected by the fake engine")
        p = request.params
        limit = p.max_tokens if p.HasField("max_tokens") else self.max_model_len - len(request.prompt_token_ids)
        finished = False
        try:
            for start in range(0, limit, self.tokens_per_reply):
                await asyncio.sleep(self.delay)
                if start == self.fail_after:
                    raise Refused(grpc.StatusCode.INTERNAL, "executor crashed at /secret/path")
                tokens, stop = [], False
                for i in range(start, min(start + self.tokens_per_reply, limit)):
                    tokens.append(self.reply[i % len(self.reply)])
                    stop = tokens[-1] in p.stop_token_ids or (tokens[-1] == self.eos and not p.ignore_eos)
                    if stop:
                        break
                finish = (pb.FINISH_REASON_STOP if stop else
                          pb.FINISH_REASON_LENGTH if i + 1 == limit else pb.FINISH_REASON_UNSPECIFIED)
                finished = bool(finish)
                logprobs = []
                if p.HasField("logprobs"):
                    logprobs = [fake_logprobs(j, t, p.logprobs, self.vocab_size) for j, t in enumerate(tokens, start)]
                yield pb.GenerateResponse(
                    token_ids=tokens, finish_reason=finish, prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=i + 1, cached_tokens=CACHED_TOKENS,
                    stop_token_id=tokens[-1] if stop else None, logprobs=logprobs)
                if finished:
                    break
        finally:
            # A cancelled request shows up as CancelledError or as the generator being closed early.
            if not finished:
                self.cancelled[request.request_id] = time.monotonic()

    async def GetModelInfo(self, request, context):
        self.info_calls += 1
        return pb.ModelInfo(served_model_name=self.model, max_model_len=self.max_model_len,
                            vocab_size=self.vocab_size, eos_token_ids=[self.eos], max_logprobs=self.max_logprobs,
                            lora_names=self.lora_names, **self.lora_info,
                            **ENGINE_STATS,
                            **self.steps, runner=self.runner, **self.pooling)

    async def Pool(self, request, context):
        self.pool_requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.reject is not None:
            await context.abort(self.reject, "rejected by the fake engine")
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled[request.request_id] = time.monotonic()
            raise
        return pb.PoolResponse(data=fake_pooled(request, self.pooling["embedding_size"],
                                                self.pooling.get("num_labels") or 1),
                               prompt_tokens=len(request.prompt_token_ids))

    async def wait_cancelled(self, count: int = 1, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.cancelled) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


async def add_fake_engine(server: grpc.aio.Server, fake: FakeEngine) -> health_aio.HealthServicer:
    """Adds the fake Engine and a health service reporting SERVING, as the scheduler has."""
    engine_pb2_grpc.add_EngineServicer_to_server(fake, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return health


async def serve_gateway(tokenizer, address: str, **options):
    runner = await start(build_app(tokenizer, address, **options), "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def serve_live_gateway(tokenizer, address: str, **options):
    """serve_gateway on a scheduler that is up, returned once /health answers 200: under load the
    engine pool's first poll (2 s deadline) can fail, and a request sent before its retry puts the
    scheduler in rotation meets a 503 (a test waiting for that request to reach the engine hung)."""
    runner, url = await serve_gateway(tokenizer, address, **options)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_health(http, url, 200, timeout=30)
    except BaseException:
        await runner.cleanup()
        raise
    return runner, url
