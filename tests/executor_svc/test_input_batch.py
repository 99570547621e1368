"""The executor masks a request's min_tokens_mask_ids, and only those, until it has min_tokens outputs;
token ids outside the vocabulary, which the scheduler refuses, never reach the model or another row."""
import numpy as np
import torch

from pagedserve.common.plan import NewRequest, StepPlan
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.executor_svc.input_batch import InputBatch
from tests.executor_svc.harness import make_worker, random_prompts
from tests.tiny_models import hf_greedy, make_tiny_model


def test_rows_mask_their_mask_ids_until_min_tokens_outputs():
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=8, vocab_size=32, device=torch.device("cpu"))
    held = SamplingParams(min_tokens=2, stop_token_ids=[9])
    rows = np.array([
        batch.add(NewRequest(1, [5, 6], 0, 2, [0], held, min_tokens_mask_ids=[0, 9])),
        # stop_token_ids alone are the scheduler's to stop on; nothing says to mask them.
        batch.add(NewRequest(2, [5], 0, 1, [1], held)),
        batch.add(NewRequest(3, [5], 0, 1, [2], SamplingParams(stop_token_ids=[9]))),
        # Re-admitted after a preemption with one output already: one more to go.
        batch.add(NewRequest(4, [5, 6, 7], 0, 3, [3], held, num_prompt_tokens=2, min_tokens_mask_ids=[4])),
    ])
    assert batch.stop_mask(rows).tolist() == [[0, 0, 3], [0, 9, 4]]
    batch.append_sampled(rows, np.array([1, 2, 3, 4]), np.array([8, 8, 8, 8]))
    assert batch.stop_mask(rows).tolist() == [[0, 0], [0, 9]]
    batch.append_sampled(rows, np.array([1, 2, 3, 4]), np.array([8, 8, 8, 8]))
    assert batch.stop_mask(rows) is None


def test_a_bad_words_last_id_is_masked_where_the_outputs_end_with_its_others():
    batch = InputBatch(max_num_seqs=4, max_model_len=64, block_size=8, vocab_size=32, device=torch.device("cpu"))
    words = SamplingParams(bad_words_token_ids=[[3], [4, 5], [6, 7, 8], [9, 40]])
    rows = np.array([
        batch.add(NewRequest(1, [4, 6, 7], 0, 3, [0], words, num_prompt_tokens=1)),  # outputs 6, 7
        batch.add(NewRequest(2, [1, 4], 0, 2, [1], words, num_prompt_tokens=2)),     # no output yet
        batch.add(NewRequest(3, [4], 0, 1, [2], SamplingParams(min_tokens=1), min_tokens_mask_ids=[0])),
    ])
    # The prompt's 4 does not start a bad word; the one-id word is always masked; [9, 40] was dropped.
    assert batch.token_mask(rows).tolist() == [[2, 0, 0, 1], [0, 3, 8, 3]]
    batch.append_sampled(rows, np.array([1, 2, 3]), np.array([4, 4, 4]))
    assert batch.banned(rows).tolist() == [[0, 0, 1, 1], [3, 5, 3, 5]]
    batch.remove(1)
    assert batch.banned(rows[1:]).tolist() == [[0, 0], [3, 5]]


def test_ids_outside_the_vocabulary_are_clamped_or_dropped():
    batch = InputBatch(max_num_seqs=2, max_model_len=64, block_size=8, vocab_size=32, device=torch.device("cpu"))
    params = SamplingParams(min_tokens=2, logit_bias={40: 5.0, 3: 1.0})
    row = batch.add(NewRequest(1, [5, -1, 32, 2**31 - 1], 0, 4, [0], params, min_tokens_mask_ids=[0, 32, 33]))
    assert batch.token_ids[row, :4].tolist() == [5, 0, 31, 31]
    assert batch.stop_mask(np.array([row])).tolist() == [[0], [0]]
    assert batch.logit_bias.lengths[row] == 1


def test_the_runner_never_samples_a_mask_id_before_min_tokens(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    prompt = random_prompts([10], seed=6)[0]
    greedy = hf_greedy(path, [prompt], 1)[0][0]
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[greedy])
    result = make_worker(path).run(StepPlan(0, new_requests=[
        NewRequest(1, list(prompt), 0, 10, [4, 9], params),
        NewRequest(2, list(prompt), 0, 10, [5, 10], params, min_tokens_mask_ids=[greedy])]))
    assert result.token_ids[0] == greedy and result.token_ids[1] != greedy
