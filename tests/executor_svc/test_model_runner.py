"""The ModelRunner, through its Worker, driven by hand-built step plans; greedy tokens must equal
transformers' generate.

The test plays the scheduler: it hands out shuffled, non-contiguous block ids, splits prompts into
chunks under a token budget, shares blocks for prefix-cache hits, drops and re-admits requests."""
import numpy as np
import pytest

from pagedserve.executor_svc import model_runner
from pagedserve.executor_svc.logits import PROMPT_LOGPROBS_CHUNK
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan
from pagedserve.common.sampling_params import SamplingParams
from tests.executor_svc.harness import (GREEDY, NEW_TOKENS, NUM_BLOCKS, MiniScheduler, Seq, logits_rows,
                                        make_worker, random_prompts)
from tests.tiny_models import ARCHITECTURES, hf_greedy, make_tiny_model

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_mixed_batch_matches_transformers(arch, tmp_path):
    path = make_tiny_model(arch, tmp_path)
    prompts = random_prompts([3, 41, 17, 9, 26])
    scheduler = MiniScheduler(make_worker(path), budget=16)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    outputs = scheduler.run_to_completion()
    assert [outputs[i] for i in range(len(prompts))] == hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mixed_steps_padded_to_graph_shapes_match_transformers(arch, tmp_path, monkeypatch):
    # As on a GPU: each step with a prompt chunk is padded to a mixed graph shape (32 tokens,
    # max_num_seqs + 1 sequences), the padding tokens owned by a sequence of their own.
    monkeypatch.setattr(model_runner, "pads_mixed_steps", lambda device: True)
    path = make_tiny_model(arch, tmp_path)
    prompts = random_prompts([3, 41, 17, 9, 26], seed=3)
    worker = make_worker(path, max_num_seqs=8)
    shapes = []
    prepare = worker.runner._prepare
    worker.runner._prepare = lambda *args: shapes.append((step := prepare(*args)).graph) or step
    scheduler = MiniScheduler(worker, budget=16, seed=3)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    outputs = scheduler.run_to_completion()
    assert [outputs[i] for i in range(len(prompts))] == hf_greedy(path, prompts, NEW_TOKENS)
    assert (32, 9, True) in shapes and (8, 8, False) in shapes


def test_mixed_graph_shapes_stop_at_max_model_len(llama, monkeypatch):
    # The padding sequence of a mixed graph reads its keys through one block-table row.
    monkeypatch.setattr(model_runner, "pads_mixed_steps", lambda device: True)
    assert make_worker(llama, max_model_len=100, max_num_batched_tokens=512).runner.shapes.mixed == [
        32, 64, 96, 100]


def test_block_size_4_one_prompt_per_step(llama):
    prompts = random_prompts([13, 5, 22], seed=1)
    scheduler = MiniScheduler(make_worker(llama, block_size=4), budget=64, seed=1)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    outputs = scheduler.run_to_completion()
    assert [outputs[i] for i in range(len(prompts))] == hf_greedy(llama, prompts, NEW_TOKENS)


def test_prefix_cache_hit_reuses_blocks_of_another_request(llama):
    shared = random_prompts([24], seed=2)[0]
    first, second = shared + [7, 8, 9], shared + [100, 200, 300, 400, 5]
    scheduler = MiniScheduler(make_worker(llama), budget=64, seed=2)
    scheduler.add(1, Seq(list(first), NEW_TOKENS))
    scheduler.step()
    cached_blocks = scheduler.seqs[1].blocks[:len(shared) // 8]
    scheduler.add(2, Seq(list(second), NEW_TOKENS, computed=len(shared), blocks=list(cached_blocks)))
    outputs = scheduler.run_to_completion()
    assert [outputs[1], outputs[2]] == hf_greedy(llama, [first, second], NEW_TOKENS)


def test_drop_mid_decode_and_readmit_after_preemption(llama):
    prompts = random_prompts([11, 30, 6], seed=3)
    expected = hf_greedy(llama, prompts, NEW_TOKENS)
    worker = make_worker(llama)
    scheduler = MiniScheduler(worker, budget=32, seed=3)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, Seq(list(prompt), NEW_TOKENS))
    for _ in range(6):
        scheduler.step()
    aborted = scheduler.drop(0)
    preempted = scheduler.drop(1)
    assert aborted.output == expected[0][:len(aborted.output)] and aborted.output
    scheduler.step()
    with pytest.raises(ValueError, match="seq_id 0"):
        worker.run(StepPlan(99, continuing=[ContinuingRequest(0, 1, [])]))
    # Re-admitted with every token known so far and fresh blocks, as after a preemption.
    scheduler.add(1, Seq(preempted.tokens, NEW_TOKENS, output=preempted.output))
    outputs = scheduler.run_to_completion()
    assert outputs[1] == expected[1] and outputs[2] == expected[2]


def test_empty_plan_returns_empty_result(llama):
    worker = make_worker(llama)
    worker.run(StepPlan(0, new_requests=[NewRequest(5, [1, 2, 3], 0, 3, [0], GREEDY)]))
    result = worker.run(StepPlan(1, dropped=[5]))
    assert (result.step_id, result.seq_ids, result.token_ids) == (1, [], [])


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama):
    prompt = random_prompts([12], seed=4)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def sample(seed_of_neighbour: int, neighbours: int) -> list[int]:
        scheduler = MiniScheduler(make_worker(llama, seed=seed_of_neighbour), budget=256)
        scheduler.add(0, Seq(list(prompt), NEW_TOKENS, sampling=seeded))
        for i in range(neighbours):
            scheduler.add(i + 1, Seq(random_prompts([5 + i], seed=i)[0], NEW_TOKENS,
                                     sampling=SamplingParams(temperature=1.0)))
        return scheduler.run_to_completion()[0]

    tokens = sample(0, 0)
    assert sample(7, 3) == tokens
    assert tokens != hf_greedy(llama, [prompt], NEW_TOKENS)[0]


def test_describe_reports_the_model_and_cache(llama):
    info = make_worker(llama, block_size=4).describe()
    assert (info.num_blocks, info.block_size, info.dtype, info.device) == (NUM_BLOCKS, 4, "float32", "cpu")
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (512, 256, [2])
    # No CUDA graphs on a CPU: the scheduler never chunks prompts beside decode rows for them.
    assert info.mixed_graph_tokens == 0


def test_dummy_run_covers_a_full_token_budget(llama):
    worker = make_worker(llama, load_format="dummy")
    rows = logits_rows(worker.model)
    worker.runner.dummy_run(num_tokens=PROMPT_LOGPROBS_CHUNK + 100, num_sample_rows=8)
    # What the memory profile measures: a chunk of prompt logprobs, then the sampled rows.
    assert rows == [PROMPT_LOGPROBS_CHUNK, 8]
    result = worker.run(StepPlan(0, new_requests=[NewRequest(1, [1, 2, 3], 0, 3, [4], GREEDY)]))
    assert result.seq_ids == [1] and 0 <= result.token_ids[0] < 512


def test_a_step_launched_before_the_previous_result_reads_its_sampled_token(llama):
    prompt = random_prompts([10], seed=5)[0]
    expected = hf_greedy(llama, [prompt], 3)[0]
    worker = make_worker(llama)
    prefill = worker.launch(StepPlan(0, new_requests=[NewRequest(1, list(prompt), 0, 10, [4, 9], GREEDY)]))
    # Position 10 holds the token the prefill samples: only the executor's device copy has it yet.
    decode = worker.launch(StepPlan(1, continuing=[ContinuingRequest(1, 1, [])]))
    with pytest.raises(ValueError, match="in flight already"):
        worker.launch(StepPlan(2, continuing=[ContinuingRequest(1, 1, [])]))
    with pytest.raises(ValueError, match="order they were launched"):
        worker.collect(decode)
    first, second = worker.collect(prefill), worker.collect(decode)
    third = worker.run(StepPlan(3, continuing=[ContinuingRequest(1, 1, [])]))
    assert [first.token_ids, second.token_ids, third.token_ids] == [[t] for t in expected]
    batch = worker.runner.batch
    assert batch.token_ids[batch.row(1), :13].tolist() == list(prompt) + expected


def test_tokens_of_a_request_dropped_while_its_step_was_in_flight_are_not_kept(llama):
    worker = make_worker(llama)
    first = worker.launch(StepPlan(0, new_requests=[NewRequest(1, [5, 6, 7], 0, 3, [3], GREEDY)]))
    # The scheduler dropped seq 1 and gave its row to seq 2 before the first result arrived.
    second = worker.launch(StepPlan(1, dropped=[1], new_requests=[NewRequest(2, [8, 9], 0, 2, [5], GREEDY)]))
    assert worker.collect(first).seq_ids == [1]
    result = worker.collect(second)
    batch = worker.runner.batch
    row = batch.row(2)
    assert result.seq_ids == [2]
    assert batch.token_ids[row, :3].tolist() == [8, 9, result.token_ids[0]]
    assert batch.num_tokens[row] == 3 and batch.known_tokens(np.array([row]))[0] == 3
