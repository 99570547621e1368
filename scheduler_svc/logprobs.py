"""Log probabilities as the scheduler hands them to requests: unpacked from a step's packed form,
attached to the step's outputs, and a prompt's gathered until its request's first output."""
from pagedserve.common.plan import PromptLogprobs, StepLogprobs, StepResult
from pagedserve.scheduler_svc.request import Request, RequestDelta, TokenLogprobs


def gather_prompt_logprobs(requests: dict[int, Request], prompt: PromptLogprobs) -> None:
    """Keeps each request's prompt logprobs until its first output; a preempted request's
    recomputed prompt brings entries it has already, which are skipped."""
    entries = unpack(prompt.logprobs)
    end = 0
    for seq_id, start, count in zip(prompt.seq_ids, prompt.starts, prompt.counts):
        first, end = end, end + count
        request = requests.get(seq_id)
        if request is None or request.prompt_logprobs_sent:
            continue
        have = len(request.prompt_logprobs) + 1
        if start <= have:
            request.prompt_logprobs += entries[first + have - start:end]


def unpack(lp: StepLogprobs) -> list[TokenLogprobs]:
    """One TokenLogprobs per entry of the packed form, in its order."""
    tokens = []
    end = 0
    for i in range(len(lp.rows)):
        start, end = end, end + lp.num_top[i]
        tokens.append(TokenLogprobs(lp.logprobs[i], lp.ranks[i], lp.top_token_ids[start:end],
                                    lp.top_logprobs[start:end]))
    return tokens


def attach_logprobs(outputs: list[RequestDelta], result: StepResult) -> None:
    lp = result.logprobs
    by_seq = {result.seq_ids[row]: token for row, token in zip(lp.rows, unpack(lp))}
    for out in outputs:
        token = by_seq.get(out.seq_id)
        if token is not None:
            out.logprobs = [token]
