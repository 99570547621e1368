"""LoRA adapters on the executor (executor_svc/lora.py): a Worker runs requests with and without
adapters in the same steps, each one's greedy tokens those of transformers on the model with its
adapter merged (W + scaling * B @ A) or on the base model; slots serve more adapters than
--max-loras over time; and what this version does not serve is refused in one line."""
import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.common.config import EngineConfig
from pagedserve.common.plan import ContinuingRequest, NewRequest, StepPlan
from pagedserve.executor_svc.lora import parse_lora_modules
from pagedserve.executor_svc.worker import Worker
from tests.executor_svc.harness import GREEDY, make_worker, random_prompts
from tests.tiny_models import hf_greedy, make_tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENTS = {"gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "down_proj": "mlp"}
# Adapter name -> (targets, rank, lora_alpha, use_rslora): every projection at rank 8, and a
# subset at rank 4 under rsLoRA's scaling, both below --max-lora-rank 16.
ADAPTERS = {"full": (ALL, 8, 16, False), "part": (("q_proj", "v_proj", "down_proj"), 4, 8, True),
            "other": (ALL, 8, 8, False)}
NEW_TOKENS = 6
BLOCKS_PER_SEQ = 8
PROMPTS = random_prompts([9, 17, 12], seed=3)


def peft_key(layer: int, target: str, part: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PARENTS.get(target, 'self_attn')}.{target}.lora_{part}.weight"


def write_adapter(path: Path, hf: transformers.PreTrainedModel, targets: tuple[str, ...], rank: int,
                  alpha: float, rslora: bool = False, seed: int = 0, **config) -> Path:
    """A PEFT adapter directory of random A [rank, in] and B [out, rank] for `targets` of `hf`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(hf.model.layers):
        for target in targets:
            module = getattr(getattr(layer, PARENTS.get(target, "self_attn")), target)
            tensors[peft_key(i, target, "A")] = torch.randn(rank, module.in_features, generator=generator) * 0.1
            tensors[peft_key(i, target, "B")] = torch.randn(module.out_features, rank, generator=generator) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    fields = dict(peft_type="LORA", r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets),
                  bias="none", modules_to_save=None) | config
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return path


def merged(hf: transformers.PreTrainedModel, adapter: Path) -> transformers.PreTrainedModel:
    """A copy of `hf` with the adapter merged into its weights: W + scaling * B @ A."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (rank ** 0.5 if config["use_rslora"] else rank)
    tensors = load_file(adapter / "adapter_model.safetensors")
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for target in config["target_modules"]:
                module = getattr(getattr(layer, PARENTS.get(target, "self_attn")), target)
                a, b = tensors[peft_key(i, target, "A")], tensors[peft_key(i, target, "B")]
                module.weight += scaling * b @ a
    return model


def adapted(root: Path, hf: transformers.PreTrainedModel, prompts: list[list[int]],
            new_tokens: int) -> tuple[dict[str, Path], dict[str, list[list[int]]]]:
    """ADAPTERS written for `hf` under `root`, and transformers' greedy tokens of each prompt under
    each adapter merged (and under none: "")."""
    adapters = {name: write_adapter(root / name, hf, targets, rank, alpha, rslora, seed=seed)
                for seed, (name, (targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items())}
    expected = {"": hf_greedy(hf, prompts, new_tokens)}
    expected |= {name: hf_greedy(merged(hf, adapter), prompts, new_tokens) for name, adapter in adapters.items()}
    return adapters, expected


class Driver:
    """Runs groups of requests on a Worker, each group's together in the same steps, every prompt
    whole in the first: the steps a scheduler would plan. A group's requests leave in the next
    group's first plan."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.step_id, self.seq_id, self.leaving = worker, 0, 0, []

    def generate(self, requests: list[tuple[list[int], str]]) -> list[list[int]]:
        ids = list(range(self.seq_id + 1, self.seq_id + 1 + len(requests)))
        self.seq_id += len(requests)
        new = [NewRequest(seq_id, prompt, 0, len(prompt), list(range(k * BLOCKS_PER_SEQ, (k + 1) * BLOCKS_PER_SEQ)),
                          GREEDY, lora_name=name)
               for k, (seq_id, (prompt, name)) in enumerate(zip(ids, requests))]
        plan = StepPlan(self.step_id, new_requests=new, dropped=self.leaving)
        self.leaving = ids
        outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
        for _ in range(NEW_TOKENS):
            result = self.worker.run(plan)
            for seq_id, token in zip(result.seq_ids, result.token_ids):
                outputs[seq_id].append(token)
            self.step_id += 1
            plan = StepPlan(self.step_id, continuing=[ContinuingRequest(seq_id, 1, []) for seq_id in ids])
        return [outputs[seq_id] for seq_id in ids]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny Llama, its adapters, transformers' greedy tokens of every prompt under each (and
    none: ""), and a Worker serving them two at a time."""
    root = tmp_path_factory.mktemp("lora")
    path = make_tiny_model("LlamaForCausalLM", root / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapters, expected = adapted(root, hf, PROMPTS, NEW_TOKENS)
    worker = make_worker(path, enable_lora=True, max_loras=2, max_lora_rank=16,
                         lora_modules=[f"{name}={adapter}" for name, adapter in adapters.items()])
    return path, adapters, expected, Driver(worker)


def test_each_adapter_changes_the_greedy_tokens(case):
    _, _, expected, _ = case
    for name in ADAPTERS:
        assert all(expected[name][i] != expected[""][i] for i in range(len(PROMPTS))), name


def test_requests_with_and_without_adapters_in_the_same_steps(case):
    _, _, expected, driver = case
    got = driver.generate([(PROMPTS[0], "full"), (PROMPTS[1], ""), (PROMPTS[2], "part")])
    assert got == [expected["full"][0], expected[""][1], expected["part"][2]]


def test_the_gpus_kernel_path_gives_the_same_tokens(case):
    """A GPU's LoraSlots keep no mask, and each projection adds its delta through kernels/lora.py,
    reading the tokens' slots: here that path runs in the Triton interpreter."""
    path, adapters, expected, _ = case
    worker = make_worker(path, enable_lora=True, max_loras=2, max_lora_rank=16,
                         lora_modules=[f"{name}={adapter}" for name, adapter in adapters.items()])
    lora = worker.runner.lora
    lora.mask = None
    for projection in lora.projections:
        projection.mask = None
    got = Driver(worker).generate([(PROMPTS[0], "full"), (PROMPTS[1], ""), (PROMPTS[2], "part")])
    assert got == [expected["full"][0], expected[""][1], expected["part"][2]]


def test_slots_serve_more_adapters_than_max_loras_over_time(case):
    _, _, expected, driver = case
    lora = driver.worker.runner.lora
    # ("", ""): a step without adapters skips the deltas (LoraSwitch off), and the next one has them again.
    for names in (("full", "part"), ("other", ""), ("", ""), ("full", "other"), ("part", "part")):
        got = driver.generate([(PROMPTS[i], name) for i, name in enumerate(names)])
        assert got == [expected[name][i] for i, name in enumerate(names)], names
        assert set(names) - {""} <= set(lora.slot_names) and lora.switch.on == any(names)
    assert len(lora.slot_names) == 2


def test_a_step_of_more_adapters_than_max_loras_is_refused(case):
    _, _, _, driver = case
    with pytest.raises(ValueError, match=r"more than --max-loras \(2\) adapters at once"):
        driver.generate([(PROMPTS[0], "full"), (PROMPTS[1], "part"), (PROMPTS[2], "other")])
    driver.worker.reset()
    driver.leaving = []


def test_describe_reports_the_adapters_in_flag_order(case):
    info = case[3].worker.describe()
    assert (info.lora_names, info.max_loras) == (list(ADAPTERS), 2)


@pytest.mark.parametrize("modules, message", [
    (["full"], "entry 'full' is neither NAME=PATH nor a JSON object"),
    (['{"name": "a"}'], "is neither NAME=PATH nor a JSON object"),
    (["a=/x", '{"name": "a", "path": "/y"}'], "names the adapter 'a' twice"),
])
def test_bad_lora_modules_are_refused(modules, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules(EngineConfig(model="m", enable_lora=True, lora_modules=modules))


def test_lora_modules_parse_in_order():
    config = EngineConfig(model="m", enable_lora=True, lora_modules=['b={"x"}', '{"name": "a", "path": "/p"}'])
    assert parse_lora_modules(config) == {"b": '{"x"}', "a": "/p"}
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        parse_lora_modules(EngineConfig(model="m", lora_modules=["a=/p"]))


@pytest.mark.parametrize("overrides, message", [
    (dict(tensor_parallel_size=2), "serves adapters on one GPU: drop --tensor-parallel-size"),
    (dict(quantization="fp8"), "not fp8 ones: drop --quantization"),
    (dict(runner="pooling"), "serves generation: drop --runner pooling"),
])
def test_engines_lora_does_not_serve_are_refused(case, overrides, message):
    path = case[0]
    with pytest.raises(ValueError, match=message):
        make_worker(path, enable_lora=True, **overrides)


def test_a_mixture_of_experts_model_is_refused(tmp_path):
    path = make_tiny_model("Qwen3MoeForCausalLM", tmp_path)
    with pytest.raises(ValueError, match="serves dense decoder models .* not Qwen3MoeForCausalLM's mixture-of-experts"):
        make_worker(path, enable_lora=True)


@pytest.mark.parametrize("change, message", [
    (dict(rank=32), "has rank 32, more than --max-lora-rank 16: raise --max-lora-rank to 32"),
    (dict(use_dora=True), r"uses DoRA \(use_dora\)"),
    (dict(bias="all"), r"uses biases \(bias='all'\)"),
    (dict(modules_to_save=["lm_head"]), r"fully trained modules \(modules_to_save\)"),
    (dict(target_modules=["q_proj", "lm_head"]), "uses target module 'lm_head'"),
    (dict(extra="base_model.model.model.embed_tokens.lora_embedding_A"), "no A or B of a decoder layer's projection"),
    (dict(extra=peft_key(5, "q_proj", "A")), "a projection this model does not have"),
    (dict(drop=peft_key(1, "up_proj", "B")), r"lora_A and lora_B are \[\(8, 64\), None\]"),
])
def test_adapters_this_version_does_not_apply_are_refused(case, tmp_path, change, message):
    path = case[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = {k: v for k, v in change.items() if k not in ("rank", "extra", "drop")}
    adapter = write_adapter(tmp_path / "bad", hf, ALL, change.get("rank", 8), 16, **config)
    if "extra" in change or "drop" in change:
        tensors = load_file(adapter / "adapter_model.safetensors")
        tensors.pop(change.get("drop"), None)
        if "extra" in change:
            tensors[change["extra"]] = torch.zeros(8, 64)
        save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=f"LoRA adapter 'bad'.*{message}"):
        make_worker(path, enable_lora=True, lora_modules=[f"bad={adapter}"])


def test_phi3_adapters_adapt_its_fused_projections_whole(tmp_path):
    # Phi-3's checkpoints fuse q/k/v and gate/up, and so do the PEFT adapters trained on them.
    path = make_tiny_model("Phi3ForCausalLM", tmp_path / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapter = write_adapter(tmp_path / "phi", hf, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), 8, 16)
    expected = hf_greedy(merged(hf, adapter), PROMPTS[:2], NEW_TOKENS)
    assert expected[0] != hf_greedy(hf, PROMPTS[:1], NEW_TOKENS)[0]
    driver = Driver(make_worker(path, enable_lora=True, lora_modules=[f"phi={adapter}"]))
    assert driver.generate([(PROMPTS[0], "phi"), (PROMPTS[1], "phi")]) == expected


@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_the_other_dense_families_take_adapters(arch, tmp_path):
    # Gemma 3's sandwich norms and scaled embedding, Qwen3's q/k norms, Qwen2's qkv bias.
    path = make_tiny_model(arch, tmp_path / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapter = write_adapter(tmp_path / "adapter", hf, ALL, 8, 16)
    base = hf_greedy(hf, PROMPTS[:2], NEW_TOKENS)
    [with_adapter] = hf_greedy(merged(hf, adapter), PROMPTS[:1], NEW_TOKENS)
    assert with_adapter != base[0]
    driver = Driver(make_worker(path, enable_lora=True, lora_modules=[f"a={adapter}"]))
    assert driver.generate([(PROMPTS[0], "a"), (PROMPTS[1], "")]) == [with_adapter, base[1]]
