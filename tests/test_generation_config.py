"""A model's generation_config.json sets the sampling options a request omits (vLLM's --generation-config)."""
import json

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.generation_config import max_tokens_cap, sampling_defaults
from tests.tiny_models import make_tiny_model


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [1, 2], "do_sample": True}))
    return tmp_path


def test_auto_reads_the_models_sampling_options(model_dir):
    assert sampling_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (model_dir / "model.gguf").write_bytes(b"")
    assert sampling_defaults(model_dir / "model.gguf") == sampling_defaults(model_dir)


def test_vllm_ignores_it_and_a_model_without_one_has_none(model_dir, tmp_path_factory):
    assert sampling_defaults(model_dir, "vllm") == {}
    assert sampling_defaults(tmp_path_factory.mktemp("bare")) == {}


def test_another_folder_and_its_errors(model_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("model")
    assert sampling_defaults(other, str(model_dir))["top_k"] == 20
    with pytest.raises(FileNotFoundError, match="--generation-config .* not found"):
        sampling_defaults(model_dir, str(other))
    (model_dir / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(model_dir)


def test_an_override_sets_options_over_the_models(model_dir):
    override = {"temperature": 0.2, "repetition_penalty": 1.1}
    assert sampling_defaults(model_dir, override=override) == {"temperature": 0.2, "top_p": 0.9, "top_k": 20,
                                                                 "repetition_penalty": 1.1}
    assert sampling_defaults(model_dir, "vllm", override) == override
    with pytest.raises(ValueError, match="sets 'max_tokens'; it sets temperature, top_p"):
        sampling_defaults(model_dir, override={"max_tokens": 5})
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(model_dir, override={"top_p": 0})


def test_max_new_tokens_is_sampling_params_max_tokens(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 512, "max_length": 20}))
    assert sampling_defaults(model_dir) == {"max_tokens": 512}
    assert sampling_defaults(model_dir, override={"max_new_tokens": 64}) == {"max_tokens": 64}
    with pytest.raises(ValueError, match=r"--override-generation-config: max_tokens must be in \[1, "):
        sampling_defaults(model_dir, override={"max_new_tokens": 0})


def test_max_tokens_is_capped_by_the_override_or_a_named_folder_as_in_vllm(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"max_new_tokens": 512}))
    assert max_tokens_cap(sampling_defaults(model_dir), "auto") is None
    assert max_tokens_cap(sampling_defaults(model_dir, "vllm"), "vllm") is None
    override = {"max_new_tokens": 64}
    assert max_tokens_cap(sampling_defaults(model_dir, override=override), "auto", override) == 64
    assert max_tokens_cap(sampling_defaults(model_dir, str(model_dir)), str(model_dir)) == 512


def test_llm_uses_them_when_no_sampling_params_are_given(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 3, "max_new_tokens": 4}))
    llm = LLM(str(path), max_model_len=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 3, 1.0, 4)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert (llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    assert LLM(str(path), max_model_len=64, generation_config="vllm").get_default_sampling_params().top_k == 0
    overridden = LLM(str(path), max_model_len=64, override_generation_config={"top_k": 5})
    assert overridden.get_default_sampling_params().top_k == 5
