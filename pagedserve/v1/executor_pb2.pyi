from pagedserve.v1 import engine_pb2 as _engine_pb2
from pagedserve.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("num_blocks", "block_size", "dtype", "device", "vocab_size", "max_model_len", "eos_token_ids", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "runner", "pooling_tasks", "embedding_size", "matryoshka_dimensions", "is_matryoshka", "num_labels", "default_prompt", "mixed_graph_tokens", "labels", "kv_cache_dtype", "max_logprobs", "lora_names", "max_loras")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    POOLING_TASKS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    IS_MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MIXED_GRAPH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    runner: str
    pooling_tasks: _containers.RepeatedScalarFieldContainer[str]
    embedding_size: int
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    is_matryoshka: bool
    num_labels: int
    default_prompt: str
    mixed_graph_tokens: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    kv_cache_dtype: str
    max_logprobs: int
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., gpu_memory_utilization: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., runner: _Optional[str] = ..., pooling_tasks: _Optional[_Iterable[str]] = ..., embedding_size: _Optional[int] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., is_matryoshka: _Optional[bool] = ..., num_labels: _Optional[int] = ..., default_prompt: _Optional[str] = ..., mixed_graph_tokens: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ..., kv_cache_dtype: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., lora_names: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_computed_tokens", "num_scheduled_tokens", "block_ids", "sampling", "num_prompt_tokens", "min_tokens_mask_ids", "pooling", "token_type_ids", "lora_name")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_MASK_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TYPE_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    num_prompt_tokens: int
    min_tokens_mask_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling: _engine_pb2.PoolingParams
    token_type_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., min_tokens_mask_ids: _Optional[_Iterable[int]] = ..., pooling: _Optional[_Union[_engine_pb2.PoolingParams, _Mapping]] = ..., token_type_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ContinuingRequest(_message.Message):
    __slots__ = ("seq_id", "num_scheduled_tokens", "new_block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_scheduled_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "continuing", "dropped")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUING_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    continuing: _containers.RepeatedCompositeFieldContainer[ContinuingRequest]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., continuing: _Optional[_Iterable[_Union[ContinuingRequest, _Mapping]]] = ..., dropped: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "forward_ns", "idle_ns", "logprobs", "prompt_logprobs", "errors", "deferred", "pooled_seq_ids", "pooled_sizes", "pooled_data")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    POOLED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLED_SIZES_FIELD_NUMBER: _ClassVar[int]
    POOLED_DATA_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_ns: int
    idle_ns: int
    logprobs: StepLogprobs
    prompt_logprobs: PromptLogprobs
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    deferred: _containers.RepeatedScalarFieldContainer[int]
    pooled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    pooled_sizes: _containers.RepeatedScalarFieldContainer[int]
    pooled_data: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., forward_ns: _Optional[int] = ..., idle_ns: _Optional[int] = ..., logprobs: _Optional[_Union[StepLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., deferred: _Optional[_Iterable[int]] = ..., pooled_seq_ids: _Optional[_Iterable[int]] = ..., pooled_sizes: _Optional[_Iterable[int]] = ..., pooled_data: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("seq_id", "code", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    code: int
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_ids", "starts", "counts", "logprobs")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    logprobs: StepLogprobs
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[StepLogprobs, _Mapping]] = ...) -> None: ...

class StepLogprobs(_message.Message):
    __slots__ = ("rows", "logprobs", "ranks", "num_top", "top_token_ids", "top_logprobs")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
