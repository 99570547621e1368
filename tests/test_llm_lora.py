"""The offline LLM with LoRA adapters, as vLLM's users write it: LLM(enable_lora=True,
lora_modules=[...]) and generate(..., lora_request=LoRARequest(name, id, path)), one request or one
per prompt; each prompt gets transformers' greedy tokens with its adapter merged, or the base
model's; an adapter not loaded at start is refused in one line."""
import pytest
import torch
import transformers

from pagedserve import LLM, LoRARequest, SamplingParams
from tests.executor_svc.test_lora import NEW_TOKENS, PROMPTS, adapted
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-lora")
    path = make_tiny_model("LlamaForCausalLM", root / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapters, expected = adapted(root, hf, PROMPTS, NEW_TOKENS)
    llm = LLM(str(path), enable_lora=True, max_loras=2, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    return llm, adapters, expected


def greedy(llm: LLM, lora_request) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=lora_request)
    return [o.outputs[0].token_ids for o in outputs]


def test_a_lora_request_per_prompt_or_for_all(case):
    llm, adapters, expected = case
    per_prompt = [LoRARequest("full", 1, str(adapters["full"])), None, LoRARequest("part", 2, str(adapters["part"]))]
    assert greedy(llm, per_prompt) == [expected["full"][0], expected[""][1], expected["part"][2]]
    assert greedy(llm, LoRARequest("other", 3, str(adapters["other"]))) == expected["other"]
    assert greedy(llm, None) == expected[""]


def test_an_adapter_not_loaded_at_start_is_refused(case, tmp_path):
    llm, adapters, _ = case
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql' \(/p\) is not among those loaded at start .*"
                                         r"lora_modules=\['sql=PATH'\]"):
        greedy(llm, LoRARequest("sql", 1, "/p"))
    with pytest.raises(ValueError, match="LoRA adapter 'full'"):
        greedy(llm, LoRARequest("full", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="got 3 prompts but 1 LoRA requests"):
        greedy(llm, [None])
