"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, no host sync."""
import torch

from pagedserve.plan import SamplingOptions

GREEDY_TEMPERATURE = 1e-5


class Sampler:
    """Samples one token per row of float32 logits [N, vocab] under each row's options.

    `generators[i]` is the request's own generator when it asked for a seed (so a seed gives the
    same tokens whatever else is in the batch), else None for the engine's global RNG."""

    def __call__(self, logits: torch.Tensor, options: list[SamplingOptions],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        greedy_rows = [o.temperature < GREEDY_TEMPERATURE for o in options]
        greedy = logits.argmax(dim=-1)
        if all(greedy_rows):
            return greedy
        temperature, min_p, top_p, top_k, is_greedy = _option_tensors(options, greedy_rows,
                                                                      logits.device)
        logits = logits / temperature[:, None]
        if any(o.min_p > 0 for o in options):
            logits = apply_min_p(logits, min_p)
        if any(o.top_p < 1.0 for o in options):
            logits = apply_top_k_top_p(logits, top_k.long(), top_p)
        elif any(o.top_k > 0 for o in options):
            logits = apply_top_k(logits, top_k.long(), max(o.top_k for o in options))
        sampled = sample_exponential(logits.softmax(dim=-1), generators, greedy_rows)
        return torch.where(is_greedy.bool(), greedy, sampled)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keeps each row's top_k largest logits (0 = all), using one topk of the largest k, no sort."""
    max_k = min(max_k, logits.shape[-1])
    top_values = logits.topk(max_k, dim=-1).values
    kth = top_values.gather(-1, (top_k.clamp(1, max_k) - 1)[:, None])
    kth = kth.masked_fill((top_k == 0)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p (the smallest set of most likely tokens whose mass reaches top_p)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token; the most likely token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_exponential(probs: torch.Tensor, generators: list[torch.Generator | None],
                       skip: list[bool]) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exponential(1) draws one token from probs (the Gumbel-max
    trick in another form) without torch.multinomial's host sync."""
    noise = torch.empty_like(probs).exponential_()
    for row, (generator, skipped) in enumerate(zip(generators, skip)):
        if generator is not None and not skipped:
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _option_tensors(options: list[SamplingOptions], greedy_rows: list[bool],
                    device: torch.device) -> tuple[torch.Tensor, ...]:
    """temperature, min_p, top_p, top_k, greedy as [N] float32 columns, in one host-to-device copy."""
    rows = [(1.0 if g else o.temperature, o.min_p, o.top_p, o.top_k, g)
            for o, g in zip(options, greedy_rows)]
    table = torch.tensor(rows, dtype=torch.float32)
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True).unbind(dim=1)
