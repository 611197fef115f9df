from modeserve.proto.v1 import forward_pb2 as _forward_pb2
from modeserve.proto.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineDescription(_message.Message):
    __slots__ = ("model", "model_path", "num_kv_slots", "page_size", "max_running_requests", "max_context_len", "vocab_size", "eos_token_ids", "cuda_graph_batch_sizes", "dp_rank", "device", "dtype", "attention_backend", "mode_stats", "num_layers", "dllm_block_size", "dllm_mask_token_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODE_STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DLLM_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DLLM_MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    num_kv_slots: int
    page_size: int
    max_running_requests: int
    max_context_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cuda_graph_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    dp_rank: int
    device: str
    dtype: str
    attention_backend: str
    mode_stats: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ModeStat]
    num_layers: int
    dllm_block_size: int
    dllm_mask_token_id: int
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., num_kv_slots: _Optional[int] = ..., page_size: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_context_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cuda_graph_batch_sizes: _Optional[_Iterable[int]] = ..., dp_rank: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., mode_stats: _Optional[_Iterable[_Union[_generate_pb2.ModeStat, _Mapping]]] = ..., num_layers: _Optional[int] = ..., dllm_block_size: _Optional[int] = ..., dllm_mask_token_id: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained", "active_streams")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    active_streams: int
    def __init__(self, drained: _Optional[bool] = ..., active_streams: _Optional[int] = ...) -> None: ...
