"""What the scheduler does differently for a pooling request (--runner pooling): it is prefill
only, its whole prompt computed in one step, after which it ends with the pooled data that step
returns and its KV blocks are freed at once.

Why whole, never chunked: mean pooling over chunks would need the executor to keep per-request
running sums across steps; scheduling the prompt whole keeps every request's hidden states in one
forward. A pooling engine's token budget is therefore at least max_model_len (as vLLM sets it for
pooling models), and a prompt past the budget is refused. Pooling requests skip the prefix cache:
every position's hidden state is needed (mean pooling), and an encoder has no KV to reuse."""
from pagedserve.common.plan import PoolingInfo
from pagedserve.common.pooling_params import PoolingParams
from pagedserve.scheduler_svc.request import Request


def check_pooling(request: Request, runner: str, info: PoolingInfo, max_model_len: int,
                  max_step_tokens: int) -> None:
    """Raises ValueError for a request that the engine of `runner` (with `info` when pooling) can
    never serve; `max_step_tokens` is the most one step computes."""
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
    if n > max_step_tokens:
        raise ValueError(f"the input has {n} tokens, more than one step computes ({max_step_tokens}); "
                         "shorten it or raise --max-num-batched-tokens")
    if request.token_type_ids and len(request.token_type_ids) != n:
        raise ValueError(f"token_type_ids has {len(request.token_type_ids)} entries for {n} tokens; "
                         "send one per token or none")
    check_pooling_params(request.pooling, info)


def check_pooling_params(params: PoolingParams, info: PoolingInfo) -> None:
    """Raises ValueError for a task the model does not serve or `dimensions` it does not allow
    (vLLM's checks and wording)."""
    if params.task not in info.tasks:
        raise ValueError(f"this model does not support the {params.task!r} task; it serves "
                         f"{', '.join(info.tasks) or 'none'}")
    d = params.dimensions
    if d is None:
        return
    if not info.is_matryoshka:
        raise ValueError("this model does not support matryoshka representation: changing output "
                         "dimensions would lead to poor results; leave dimensions unset")
    if info.matryoshka_dimensions and d not in info.matryoshka_dimensions:
        raise ValueError(f"this model only supports {info.matryoshka_dimensions} for matryoshka "
                         f"representation, got dimensions={d}")
    if d > info.embedding_size:
        raise ValueError(f"dimensions={d} exceeds the model's embedding size {info.embedding_size}")
