"""vLLM's `use_beam_search`: the n most likely continuations of a prompt, found as vLLM finds them
(common/beam.py's rounds).

Each round asks the engine for one greedy token of every live beam with its 2n most likely tokens'
logprobs (one request per beam; the prefix cache holds what the beams share). After max_tokens
rounds, or when no beam lives, the best n are the choices. Nothing streams before the search ends:
the choices come whole, as in vLLM. Stop strings and constraints play no part."""
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from pagedserve.common.beam import Beam, Candidates, Search, best, grow, output_tokens
from pagedserve.common.sampling_params import SamplingParams, sampling_to_proto
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.gateway.engine_client import ModelSpec
from pagedserve.gateway.errors import bad_request
from pagedserve.gateway.generation import Choice, ChoiceEvent, Generation
from pagedserve.gateway.logprobs import TokenLogprob
from pagedserve.gateway.schemas import SamplingFields, Usage


def candidates(top: TokenLogprob) -> Candidates:
    """A round's top list as a beam's candidates, each keeping its own TokenLogprob."""
    return [(token, logprob, TokenLogprob(token, text, logprob, rank, top.top))
            for rank, (token, text, logprob) in enumerate(top.top, 1)]


async def search(prompt: list[int], rule: Search,
                 step: Callable[[list[Beam]], Awaitable[list[TokenLogprob]]]) -> list[Beam]:
    """The `rule.width` best continuations of `prompt`, best first; `step` gives each beam's next
    token's top logprobs."""
    live, done = [Beam(list(prompt))], []
    for _ in range(rule.max_tokens):
        live = grow(live, [candidates(top) for top in await step(live)], rule, done)
        if not live:
            break
    return best(live, done, rule)


class BeamSearch:
    """A request's beam searches (one per prompt), in Generation's place: events() yields each
    prompt's n best continuations, choice p * n + i the i-th best of prompt p. Each round is a
    Generation like `rounds`, of one-token requests."""

    def __init__(self, request_id: str, rounds: Generation, params: SamplingParams, rule: Search,
                 prompts: list[list[int]], tokenizer: Tokenizer) -> None:
        self._request_id = request_id
        self._rounds = rounds
        self.metrics, self.log = rounds.metrics, rounds.log
        self._params = params
        self._rule = rule
        self._prompts = prompts
        self._tokenizer = tokenizer
        # Greedy, so that the token sampled is the top one; the logprobs are of the raw logits either way.
        self._one_token = replace(params, n=1, max_tokens=1, temperature=0.0, min_tokens=0, stop=[],
                                  logprobs=2 * rule.width, prompt_logprobs=None)
        self._wire = sampling_to_proto(self._one_token)
        self._best: list[list[Beam]] = []
        self._round = 0
        self._running: set[Generation] = set()
        self._interrupted: Exception | None = None

    def usage(self) -> Usage:
        prompt = sum(map(len, self._prompts))
        completion = sum(len(b.tokens) - len(self._prompts[p]) for p, beams in enumerate(self._best) for b in beams)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def choice_usage(self, index: int) -> Usage:
        prompt = len(self._prompts[index // self._rule.width])
        return Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt)

    def interrupt(self, error: Exception) -> None:
        """Ends the search with `error` (a shutdown): the round running now raises it."""
        self._interrupted = error
        for generation in self._running:
            generation.interrupt(error)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        self._best = list(await asyncio.gather(*(search(p, self._rule, self._step) for p in self._prompts)))
        for p, beams in enumerate(self._best):
            for i, beam in enumerate(beams):
                yield self._event(p * self._rule.width + i, beam, len(self._prompts[p]))

    def _event(self, index: int, beam: Beam, prompt_length: int) -> ChoiceEvent:
        out = beam.tokens[prompt_length:]
        shown = output_tokens(beam, prompt_length, self._params.include_stop_str_in_output)
        text = self._tokenizer.decode(shown, self._params.skip_special_tokens)
        asked = self._params.logprobs
        logprobs = [] if asked is None else [replace(lp, top=lp.top[:asked]) for lp in beam.logprobs]
        return ChoiceEvent(index, text, beam.finish_reason, logprobs=logprobs, token_ids=out)

    async def _step(self, beams: list[Beam]) -> list[TokenLogprob]:
        """One token of each beam, with its top 2n logprobs."""
        if self._interrupted is not None:
            raise self._interrupted
        self._round += 1
        routing = self._rounds.choices[0].routing
        choices = [Choice(i, f"{self._request_id}-beam{self._round}-{i}", beam.tokens, self._one_token,
                          self._wire, counts_prompt=True, routing=routing) for i, beam in enumerate(beams)]
        generation = self._rounds.like(choices)
        tops: list[TokenLogprob] = [None] * len(beams)
        self._running.add(generation)
        try:
            async for event in generation.events():
                if event.logprobs:
                    tops[event.index] = event.logprobs[0]
        finally:
            self._running.discard(generation)
        return tops


def beam_search(request_id: str, rounds: Generation, req: SamplingFields, prompts: list[list[int]],
                tokenizer: Tokenizer, spec: ModelSpec, max_tokens: int | None, constrained: bool) -> BeamSearch:
    """The beam search that stands in for `rounds` (the request's plain generation); a 400 for what a
    search cannot honour: it ranks by the raw logprobs, which no constraint or bias moves."""
    if constrained or req.logit_bias or req.bad_words:
        raise bad_request("use_beam_search ranks continuations by the model's own logprobs, which a structured "
                          "output, a forced tool, logit_bias or bad_words would not change; remove them or "
                          "use_beam_search.", param="use_beam_search")
    width = req.n or 1
    if 2 * width > spec.max_logprobs:
        raise bad_request(f"use_beam_search asks for the {2 * width} most likely tokens at each step (2 x n), past "
                          f"this server's --max-logprobs ({spec.max_logprobs}); send n at most "
                          f"{spec.max_logprobs // 2}.", param="n")
    params = rounds.choices[0].params
    allowed = frozenset(params.allowed_token_ids) if params.allowed_token_ids else None
    limit = max_tokens if max_tokens is not None else spec.max_model_len - max(map(len, prompts))
    rule = Search(width, limit, tokenizer.eos_token_id, params.ignore_eos, req.length_penalty, allowed)
    return BeamSearch(request_id, rounds, params, rule, prompts, tokenizer)
