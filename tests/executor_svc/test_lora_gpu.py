"""On a CUDA GPU: LoRA requests beside base ones replay the decode CUDA graphs, whose slots take
new adapters in place, and give the tokens of transformers with each adapter merged (float32)."""
import pytest
import torch
import transformers

from tests.executor_svc.harness import make_worker
from tests.executor_svc.test_lora import NEW_TOKENS, PROMPTS, Driver, adapted
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_adapters_through_cuda_graphs(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapters, expected = adapted(tmp_path, hf, PROMPTS, NEW_TOKENS)
    worker = make_worker(path, device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                         lora_modules=[f"{name}={adapter}" for name, adapter in adapters.items()])
    assert worker.runner.graphs.graphs.keys() == worker.runner.graphs.base_graphs.keys()
    driver = Driver(worker)
    # ("", "", ""): replays the graphs captured without the LoRA deltas.
    for names in (("full", "", "part"), ("other", "", ""), ("", "", ""), ("full", "other", ""), ("part", "", "part")):
        got = driver.generate([(PROMPTS[i], name) for i, name in enumerate(names)])
        assert got == [expected[name][i] for i, name in enumerate(names)], names
