"""pagedserve: PagedAttention, continuous batching and an OpenAI-compatible API."""

from pagedserve.common.version import __version__

__all__ = ["BeamSearchParams", "LLM", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that the gateway can import pagedserve.common.config without pulling in torch.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM
        return LLM
    if name == "LoRARequest":
        from pagedserve.common.lora_request import LoRARequest
        return LoRARequest
    if name == "PoolingParams":
        from pagedserve.common.pooling_params import PoolingParams
        return PoolingParams
    if name == "SamplingParams":
        from pagedserve.common.sampling_params import SamplingParams
        return SamplingParams
    if name == "BeamSearchParams":
        from pagedserve.common.sampling_params import BeamSearchParams
        return BeamSearchParams
    raise AttributeError(name)
