"""What the scheduler does differently for a pooling request (--runner pooling): it is prefill
only, its whole prompt computed in one step, after which it ends with the pooled data that step
returns and its KV blocks are freed at once.

Why whole, never chunked: mean pooling over chunks would need the executor to keep per-request
running sums across steps; scheduling the prompt whole keeps every request's hidden states in one
forward. A pooling engine's token budget is therefore at least max_model_len (as vLLM sets it for
pooling models), and a prompt past the budget is refused. Pooling requests skip the prefix cache:
every position's hidden state is needed (mean pooling), and an encoder has no KV to reuse."""
from pagedserve.scheduler_svc.request import Request


def check_pooling(request: Request, runner: str, max_model_len: int, max_num_batched_tokens: int,
                  kv_capacity: int) -> None:
    """Raises ValueError for a request that the engine of `runner` can never serve."""
    pooling = request.pooling is not None
    if pooling and runner != "pooling":
        raise ValueError("this model is served for generation (--runner generate); start the engine "
                         "with --runner pooling to embed, classify or score")
    if runner == "pooling" and not pooling:
        raise ValueError("this model is served with --runner pooling: it embeds, classifies and scores "
                         "but does not generate text")
    if not pooling:
        return
    n = len(request.prompt_token_ids)
    if n > max_model_len:
        raise ValueError(f"this model's maximum context length is {max_model_len} tokens, but the input "
                         f"has {n} tokens; shorten it")
    if n > min(max_num_batched_tokens, kv_capacity):
        raise ValueError(f"the input has {n} tokens, more than one step computes "
                         f"({min(max_num_batched_tokens, kv_capacity)}); shorten it or raise "
                         "--max-num-batched-tokens")
    if request.token_type_ids and len(request.token_type_ids) != n:
        raise ValueError(f"token_type_ids has {len(request.token_type_ids)} entries for {n} tokens; "
                         "send one per token or none")
