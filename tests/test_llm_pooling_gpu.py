"""On a CUDA GPU: pooling through the Triton paged prefill (a decoder) and the GPU encoder, in
float32 and bf16, against the same model on the CPU."""
import numpy as np
import pytest
import torch

from pagedserve import LLM
from tests.tiny_encoders import make_sentence_transformer
from tests.tiny_models import make_tiny_model, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TEXTS = ["what is the capital of france", "paris", "the river in the city of berlin is a river of germany"]
# Largest component difference of unit vectors: fp32 (TF32 off) and bf16 against the CPU's fp32.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_embeddings_on_the_gpu_equal_the_cpus(tmp_path, dtype):
    path = str(make_tiny_model("Qwen3ForCausalLM", tmp_path / "m"))
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(seed=4)]
    cpu = LLM(path, runner="pooling", device="cpu", block_size=16).embed(prompts, use_tqdm=False)
    gpu = LLM(path, runner="pooling", device="cuda", dtype=dtype).embed(prompts, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.embedding for o in gpu], [o.outputs.embedding for o in cpu],
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_encoder_embeddings_on_the_gpu_equal_the_cpus(tmp_path, dtype):
    path = str(make_sentence_transformer(tmp_path / "st", arch="XLMRobertaModel"))
    cpu = LLM(path, device="cpu").embed(TEXTS, use_tqdm=False)
    gpu = LLM(path, device="cuda", dtype=dtype).embed(TEXTS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.embedding for o in gpu], [o.outputs.embedding for o in cpu],
                               atol=TOLERANCE[dtype])
