"""What the scheduler checks of a new request's prompt against the context and the KV cache."""
from pagedserve.common.sampling_params import MAX_CACHE_SALT_CHARS
from pagedserve.scheduler_svc.request import Request


def check_prompt(request: Request, max_model_len: int, max_len: int, kv_capacity: int) -> None:
    """Raises ValueError for an empty prompt, a generation prompt that leaves no room for output in
    the context (max_model_len) or the KV cache (max_len: kv_capacity + 1 tokens at most), or a
    cache_salt past its bound."""
    n = len(request.prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: send at least one token")
    if request.pooling is None and n >= max_model_len:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {n} "
            f"tokens; shorten it to at most {max_model_len - 1} tokens to leave room for output")
    if request.pooling is None and n >= max_len:
        raise ValueError(
            f"the KV cache holds {kv_capacity} tokens, but the prompt has {n} tokens; shorten it "
            f"to at most {max_len - 1} tokens or give the server more KV cache memory")
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt holds {len(request.cache_salt)} characters; at most "
                         f"{MAX_CACHE_SALT_CHARS} are allowed")


def check_lora(lora_name: str, served: frozenset[str]) -> None:
    """Raises ValueError for an adapter the executor does not serve."""
    if lora_name and lora_name not in served:
        names = ", ".join(sorted(served)) or "none (start it with --enable-lora --lora-modules NAME=PATH)"
        raise ValueError(f"no LoRA adapter named {lora_name[:64]!r} is served here; served: {names}")
