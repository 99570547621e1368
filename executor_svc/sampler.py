"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, no host sync;
before it the token mask (min_tokens' stop ids, bad words), the grammar mask, allowed_token_ids,
logit_bias and penalties, around it logprobs (executor_svc/logits.py)."""
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.common.config import LOGPROBS_MODES
from pagedserve.executor_svc.logits import (GrammarMask, LogitBias, LogprobRows, Penalties, SampledLogprobs,
                                            gather_logprobs, mask_tokens)
from pagedserve.kernels.argmax import argmax

GREEDY_TEMPERATURE = 1e-5
# A row's Philox seed is drawn below this from the CUDA generator (the request's own, for a
# request with a seed).
SEED_BOUND = 2**62


@dataclass(slots=True)
class SamplingBatch:
    """The options of the rows to sample, as device columns [N]; an option no sampled row uses is
    None so that its pass over the logits is skipped. Greedy rows carry temperature 1."""
    all_greedy: bool
    greedy: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    # A row's temperature, 0 for a greedy row: the scale of its noise where sampling folds the
    # temperature into the argmax (sample_exponential).
    noise_scale: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    max_top_k: int = 0
    # Row -> the request's own generator, for seeded rows that sample (the rest use the global RNG).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # [2, n] (row, token id): tokens a row may not sample, its stop tokens before min_tokens and its
    # bad words' last tokens.
    token_mask: torch.Tensor | None = None
    grammar: GrammarMask | None = None
    # The rows that set allowed_token_ids, and their masks.
    allowed: GrammarMask | None = None
    logit_bias: LogitBias | None = None
    penalties: Penalties | None = None
    logprobs: LogprobRows | None = None

    def takes_argmax_only(self) -> bool:
        """Whether each row's token is the argmax of its logits as given, unperturbed (greedy) or
        with the kernel's noise scaled by its temperature (nothing cut): no option edits or
        normalizes them."""
        options = (self.token_mask, self.grammar, self.allowed, self.logit_bias, self.penalties,
                   self.logprobs, self.min_p, self.top_p, self.top_k)
        return all(option is None for option in options)


@dataclass(slots=True)
class SamplerOutput:
    tokens: torch.Tensor                    # [N]
    logprobs: SampledLogprobs | None = None  # of SamplingBatch.logprobs' rows, in their order


def make_sampling_batch(temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray,
                        min_p: np.ndarray, generators: dict[int, torch.Generator],
                        upload: Callable[[np.ndarray], torch.Tensor]) -> SamplingBatch:
    """Builds the device columns from host columns [N] with one copy (`upload`)."""
    greedy = temperature < GREEDY_TEMPERATURE
    if greedy.all():
        return SamplingBatch(all_greedy=True)
    sampled = ~greedy
    table = upload(np.stack((np.where(greedy, 1.0, temperature), np.where(greedy, 0.0, temperature), top_p,
                             top_k, min_p, greedy)).astype(np.float32))
    temperature_t, noise_scale_t, top_p_t, top_k_t, min_p_t, greedy_t = table.unbind(0)
    use_top_p = bool((top_p[sampled] < 1.0).any())
    use_top_k = bool((top_k[sampled] > 0).any())
    return SamplingBatch(
        all_greedy=False, greedy=greedy_t.bool() if greedy.any() else None,
        temperature=temperature_t if (temperature[sampled] != 1.0).any() else None, noise_scale=noise_scale_t,
        top_p=top_p_t if use_top_p else None,
        top_k=top_k_t.long() if use_top_k or use_top_p else None,
        min_p=min_p_t if (min_p[sampled] > 0).any() else None,
        max_top_k=int(top_k[sampled].max()),
        generators={row: g for row, g in generators.items() if sampled[row]})


class Sampler:
    """Samples one token per row of logits [N, vocab] under each row's options, in float32 where
    an option edits or normalizes them.

    A seeded row draws its noise from its own generator, so a seed gives the same tokens whatever
    else is in the batch. Logprobs hold what `logprobs_mode` (vLLM's --logprobs-mode) names: raw
    ones come from the logits as given, which the stop mask and penalties then change in place;
    processed ones from the logits a row samples from."""

    def __init__(self, logprobs_mode: str = LOGPROBS_MODES[0]) -> None:
        self.processed = logprobs_mode.startswith("processed")
        self.as_logits = logprobs_mode.endswith("logits")

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.is_cuda and batch.takes_argmax_only():
            # Not widened: a float32 copy of every step's logits took about 60 of the 10,567 ms an
            # offline FP8 + FP8 KV run spent on an H100, and the argmax kernel widens each value
            # exactly as it loads it.
            if batch.all_greedy:
                return SamplerOutput(row_argmax(logits))
            return SamplerOutput(sample_exponential(logits, batch.generators, batch.noise_scale))
        logits = logits.float()
        raw = None
        if batch.logprobs is not None and not self.processed:
            # Indexing copies the rows: the processors below change `logits` in place.
            raw = self._values(logits[batch.logprobs.device_index])
        if batch.token_mask is not None:
            mask_tokens(logits, batch.token_mask[0], batch.token_mask[1])
        if batch.grammar is not None:
            batch.grammar.apply(logits)
        if batch.allowed is not None:
            batch.allowed.apply(logits)
        if batch.logit_bias is not None:
            batch.logit_bias.apply(logits)
        if batch.penalties is not None:
            batch.penalties.apply(logits)
        tokens, processed = self._sample(logits, batch)
        rows = batch.logprobs
        if rows is None:
            return SamplerOutput(tokens)
        values = raw if raw is not None else self._values(processed[rows.device_index])
        return SamplerOutput(tokens, gather_logprobs(values, tokens[rows.device_index], rows.max_top))

    def _values(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.as_logits else logits.log_softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled tokens and the logits they were sampled from (temperature, min_p, top_k and
        top_p applied; greedy rows at temperature 1)."""
        if batch.all_greedy:
            return row_argmax(logits), logits
        greedy = row_argmax(logits) if batch.greedy is not None else None
        if batch.temperature is not None:
            logits = logits / batch.temperature[:, None]
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        elif batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
        sampled = sample_rows(logits, batch.generators)
        if greedy is None:
            return sampled, logits
        return torch.where(batch.greedy, greedy, sampled), logits


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
    """Top-k then top-p (the smallest set of most likely tokens whose mass reaches top_p): by a
    sort of each row on a GPU, by a threshold logit on the CPU."""
    if logits.is_cuda:
        return top_k_top_p_sorted(logits, top_k, top_p)
    return top_k_top_p_by_threshold(logits, top_k, top_p)


def top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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


def top_k_top_p_by_threshold(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k_top_p_sorted's cut as a least logit each row keeps, found on the row's values sorted
    alone; tokens tied with it all stay.

    torch's CPU sort, which also orders the indices, took 17 ms for 16 rows of 49,152 on the 2-core
    machine and the sorted cut 31 ms; numpy's vectorized sort of the values 2.1 ms."""
    vocab = logits.shape[-1]
    ordered = torch.from_numpy(np.sort(logits.neg().numpy(), axis=-1)).neg_()
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    mass = ordered.masked_fill(torch.arange(vocab) >= k, float("-inf")).softmax(dim=-1).cumsum_(dim=-1)
    # The most likely token always stays, then each next one while the mass before it is under
    # top_p; top_p 1 keeps the top k, where the sum's rounding would cut the least likely.
    kept = (torch.searchsorted(mass, top_p[:, None].contiguous()) + 1).clamp_(max=k)
    kept = torch.where(top_p[:, None] < 1, kept, k)
    return logits.masked_fill(logits < ordered.gather(-1, kept - 1), float("-inf"))


def sample_rows(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token a row from softmax(logits): the Gumbel-max trick on a GPU, the inverse of the
    cumulative distribution on the CPU."""
    if logits.is_cuda:
        return sample_exponential(logits, generators)
    return sample_inverse_cdf(logits, generators)


def sample_exponential(logits: torch.Tensor, generators: dict[int, torch.Generator],
                       noise_scale: torch.Tensor | None = None) -> torch.Tensor:
    """On a GPU: argmax(logits - log E) with E ~ Exponential(1) draws one token from
    softmax(logits) (the Gumbel-max trick, as argmax(probs / E) in log space) without a softmax or
    torch.multinomial's host sync; with `noise_scale`, T a row, argmax(logits - T log E) draws from
    softmax(logits / T) without a pass that divides them (T = 0: the argmax). The kernel draws E
    from a seed a row: noise written by exponential_ and read back took 301 against 240 us at 512
    rows of 128,256 logits, 161 against 126 at 256 (an H100), and a seeded row launched an
    exponential_ over the vocabulary."""
    seeds = torch.randint(SEED_BOUND, (len(logits),), device=logits.device)
    for row, generator in generators.items():
        seeds[row:row + 1] = torch.randint(SEED_BOUND, (1,), device=logits.device, generator=generator)
    return argmax(logits, seeds, noise_scale)


def sample_inverse_cdf(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The first token whose cumulative probability passes a uniform draw of its row's total.

    torch's CPU exponential_ draws about 16 ns an element on one thread: 13.6 ms for 16 rows of a
    49,152-token vocabulary, a fifth of the default model's step; this takes 0.57 ms (0.07 against
    0.86 at one row). The cumulative sum runs along each row in order, so it never decreases, and
    the draw stays under the row's total: the token found always has a nonzero probability."""
    cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1:]
    draw = torch.rand(len(logits), 1)
    for row, generator in generators.items():
        draw[row] = torch.rand(1, generator=generator)
    point = draw.mul_(total).clamp_(max=total.nextafter(torch.zeros(())))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value: the Triton kernel on a GPU, where torch's
    argmax is slow on long rows; on the CPU torch's max, which takes a third of argmax's time there
    (0.16 against 0.51 ms at 16 rows of 49,152)."""
    if x.is_cuda:
        return argmax(x)
    return x.max(dim=-1).indices
