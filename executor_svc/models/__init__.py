"""The model families, one per file, each built from the shared decoder pieces of
executor_svc/layers/, and the maps from config.json's architecture name to the class that runs
it, decoders (MODELS) and encoders (ENCODERS): model_config refuses any architecture they do not
name."""
from pagedserve.executor_svc.attention_backend import TorchAttentionBackend
from pagedserve.executor_svc.layers.decoder import CausalLM
from pagedserve.executor_svc.model_config import ModelConfig
from pagedserve.executor_svc.models.bert import (BertForSequenceClassification, BertModel,
                                                 XLMRobertaForSequenceClassification, XLMRobertaModel)
from pagedserve.executor_svc.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedserve.executor_svc.models.llama import LlamaForCausalLM
from pagedserve.executor_svc.models.moe import MixtralForCausalLM, MoeForCausalLM
from pagedserve.executor_svc.parallel import TensorParallel

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
}
# Encoders run by the pooling runner only: no KV cache, forward(input_ids, positions,
# token_type_ids, seq_lens) over packed sequences.
ENCODERS: dict[str, type[BertModel]] = {
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}


def build_model(config: ModelConfig, backend: TorchAttentionBackend, max_positions: int,
                tp: TensorParallel | None = None) -> CausalLM | BertModel:
    """The model of `config.architecture`, its parameters uninitialised (the weight loader fills
    them), on the default device and dtype; rotary tables cover `max_positions`. An encoder
    runs on one device: it refuses tensor parallelism."""
    if config.architecture in ENCODERS:
        if tp is not None and tp.size > 1:
            raise ValueError(f"{config.architecture} is an encoder, which pagedserve runs on one GPU; "
                             "drop --tensor-parallel-size (-tp)")
        return ENCODERS[config.architecture](config)
    return MODELS[config.architecture](config, backend, max_positions, tp)
