"""ModelRunner driven by hand-built step plans; greedy tokens must equal transformers' generate.

The test plays the scheduler: it hands out shuffled, non-contiguous block ids, splits prompts into
chunks under a token budget, shares blocks for prefix-cache hits, drops and re-admits requests."""
import random
from dataclasses import dataclass, field

import pytest

from executor_svc.model_runner import ModelRunner
from pagedserve.config import EngineConfig
from pagedserve.plan import ContinuingRequest, NewRequest, SamplingOptions, StepPlan
from tests.tiny_models import ARCHITECTURES, hf_greedy, make_tiny_model

NUM_BLOCKS = 96
NEW_TOKENS = 20
GREEDY = SamplingOptions(temperature=0.0)


@dataclass(slots=True)
class Seq:
    tokens: list[int]
    max_new: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    sent: bool = False
    sampling: SamplingOptions = field(default_factory=lambda: GREEDY)


class MiniScheduler:
    """Just enough of a scheduler to build plans: first come first served under a token budget."""

    def __init__(self, runner: ModelRunner, budget: int, seed: int = 0) -> None:
        self.runner, self.budget = runner, budget
        self.block_size = runner.describe().block_size
        self.free = list(range(runner.describe().num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[int, Seq] = {}
        self.finished: dict[int, list[int]] = {}
        self.to_drop: list[int] = []
        self.step_id = 0

    def add(self, seq_id: int, seq: Seq) -> None:
        self.seqs[seq_id] = seq

    def step(self) -> None:
        plan = StepPlan(self.step_id, dropped=self.to_drop)
        self.step_id, self.to_drop, left, scheduled = self.step_id + 1, [], self.budget, {}
        for seq_id, seq in self.seqs.items():
            n = min(len(seq.tokens) - seq.computed, left)
            if n == 0:
                continue
            needed = -(-(seq.computed + n) // self.block_size) - len(seq.blocks)
            new_blocks = [self.free.pop() for _ in range(max(needed, 0))]
            seq.blocks += new_blocks
            if seq.sent:
                plan.continuing.append(ContinuingRequest(seq_id, n, new_blocks))
            else:
                plan.new_requests.append(NewRequest(seq_id, list(seq.tokens), seq.computed, n,
                                                    list(seq.blocks), seq.sampling))
                seq.sent = True
            scheduled[seq_id], left = n, left - n
        result = self.runner.run(plan)
        assert result.step_id == plan.step_id
        for seq_id, n in scheduled.items():
            self.seqs[seq_id].computed += n
        plan_order = [r.seq_id for r in plan.new_requests] + [r.seq_id for r in plan.continuing]
        sampled = [s for s in plan_order if self.seqs[s].computed == len(self.seqs[s].tokens)]
        assert result.seq_ids == sampled
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            seq = self.seqs[seq_id]
            seq.tokens.append(token)
            seq.output.append(token)
            if len(seq.output) == seq.max_new:
                self.drop(seq_id)
                self.finished[seq_id] = seq.output

    def drop(self, seq_id: int) -> Seq:
        self.to_drop.append(seq_id)
        return self.seqs.pop(seq_id)

    def run_to_completion(self) -> dict[int, list[int]]:
        while self.seqs:
            self.step()
        return self.finished


def make_runner(path, block_size: int = 8, **overrides) -> ModelRunner:
    config = EngineConfig(model=str(path), block_size=block_size, num_gpu_blocks_override=NUM_BLOCKS,
                          device="cpu", max_model_len=256, **overrides)
    return ModelRunner(config)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_mixed_batch_matches_transformers(arch, tmp_path):
    path = make_tiny_model(arch, tmp_path)
    prompts = random_prompts([3, 41, 17, 9, 26])
    scheduler = MiniScheduler(make_runner(path), budget=16)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    outputs = scheduler.run_to_completion()
    assert [outputs[i] for i in range(len(prompts))] == hf_greedy(path, prompts, NEW_TOKENS)


def test_block_size_4_one_prompt_per_step(llama):
    prompts = random_prompts([13, 5, 22], seed=1)
    scheduler = MiniScheduler(make_runner(llama, block_size=4), budget=64, seed=1)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    outputs = scheduler.run_to_completion()
    assert [outputs[i] for i in range(len(prompts))] == hf_greedy(llama, prompts, NEW_TOKENS)


def test_prefix_cache_hit_reuses_blocks_of_another_request(llama):
    shared = random_prompts([24], seed=2)[0]
    first, second = shared + [7, 8, 9], shared + [100, 200, 300, 400, 5]
    scheduler = MiniScheduler(make_runner(llama), budget=64, seed=2)
    scheduler.add(1, Seq(list(first), NEW_TOKENS))
    scheduler.step()
    cached_blocks = scheduler.seqs[1].blocks[:len(shared) // 8]
    scheduler.add(2, Seq(list(second), NEW_TOKENS, computed=len(shared), blocks=list(cached_blocks)))
    outputs = scheduler.run_to_completion()
    assert [outputs[1], outputs[2]] == hf_greedy(llama, [first, second], NEW_TOKENS)


def test_drop_mid_decode_and_readmit_after_preemption(llama):
    prompts = random_prompts([11, 30, 6], seed=3)
    expected = hf_greedy(llama, prompts, NEW_TOKENS)
    runner = make_runner(llama)
    scheduler = MiniScheduler(runner, budget=32, seed=3)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    for _ in range(6):
        scheduler.step()
    aborted = scheduler.drop(0)
    preempted = scheduler.drop(1)
    assert aborted.output == expected[0][:len(aborted.output)] and aborted.output
    scheduler.step()
    with pytest.raises(ValueError, match="seq_id 0"):
        runner.run(StepPlan(99, continuing=[ContinuingRequest(0, 1, [])]))
    # Re-admitted with every token known so far and fresh blocks, as after a preemption.
    scheduler.add(1, Seq(preempted.tokens, NEW_TOKENS, output=preempted.output))
    outputs = scheduler.run_to_completion()
    assert outputs[1] == expected[1] and outputs[2] == expected[2]


def test_empty_plan_returns_empty_result(llama):
    runner = make_runner(llama)
    runner.run(StepPlan(0, new_requests=[NewRequest(5, [1, 2, 3], 0, 3, [0], GREEDY)]))
    result = runner.run(StepPlan(1, dropped=[5]))
    assert (result.step_id, result.seq_ids, result.token_ids) == (1, [], [])


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama):
    prompt = random_prompts([12], seed=4)[0]
    seeded = SamplingOptions(temperature=1.0, top_p=0.95, seed=1234)

    def sample(seed_of_neighbour: int, neighbours: int) -> list[int]:
        scheduler = MiniScheduler(make_runner(llama, seed=seed_of_neighbour), budget=256)
        scheduler.add(0, Seq(list(prompt), NEW_TOKENS, sampling=seeded))
        for i in range(neighbours):
            scheduler.add(i + 1, Seq(random_prompts([5 + i], seed=i)[0], NEW_TOKENS,
                                     sampling=SamplingOptions(temperature=1.0)))
        return scheduler.run_to_completion()[0]

    tokens = sample(0, 0)
    assert sample(7, 3) == tokens
    assert tokens != hf_greedy(llama, [prompt], NEW_TOKENS)[0]


def test_describe_reports_the_model_and_cache(llama):
    info = make_runner(llama, block_size=4).describe()
    assert (info.num_blocks, info.block_size, info.dtype, info.device) == (NUM_BLOCKS, 4, "float32", "cpu")
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (512, 256, [2])


def test_dummy_run_covers_a_full_token_budget(llama):
    runner = make_runner(llama, load_format="dummy")
    runner.dummy_run(num_tokens=300, num_sample_rows=8)
    result = runner.run(StepPlan(0, new_requests=[NewRequest(1, [1, 2, 3], 0, 3, [4], GREEDY)]))
    assert result.seq_ids == [1] and 0 <= result.token_ids[0] < 512
