from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForwardMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARD_MODE_UNSPECIFIED: _ClassVar[ForwardMode]
    FORWARD_MODE_EXTEND: _ClassVar[ForwardMode]
    FORWARD_MODE_DECODE: _ClassVar[ForwardMode]
    FORWARD_MODE_MIXED: _ClassVar[ForwardMode]
    FORWARD_MODE_IDLE: _ClassVar[ForwardMode]
    FORWARD_MODE_TARGET_VERIFY: _ClassVar[ForwardMode]
    FORWARD_MODE_DRAFT_EXTEND: _ClassVar[ForwardMode]
    FORWARD_MODE_DLLM_EXTEND: _ClassVar[ForwardMode]
    FORWARD_MODE_SPLIT_PREFILL: _ClassVar[ForwardMode]
FORWARD_MODE_UNSPECIFIED: ForwardMode
FORWARD_MODE_EXTEND: ForwardMode
FORWARD_MODE_DECODE: ForwardMode
FORWARD_MODE_MIXED: ForwardMode
FORWARD_MODE_IDLE: ForwardMode
FORWARD_MODE_TARGET_VERIFY: ForwardMode
FORWARD_MODE_DRAFT_EXTEND: ForwardMode
FORWARD_MODE_DLLM_EXTEND: ForwardMode
FORWARD_MODE_SPLIT_PREFILL: ForwardMode

class SlotSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ...) -> None: ...

class ReqAdmission(_message.Message):
    __slots__ = ("req_pool_idx", "sampling", "seed", "prompt_len")
    REQ_POOL_IDX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    req_pool_idx: int
    sampling: SlotSampling
    seed: int
    prompt_len: int
    def __init__(self, req_pool_idx: _Optional[int] = ..., sampling: _Optional[_Union[SlotSampling, _Mapping]] = ..., seed: _Optional[int] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class SlotUpdate(_message.Message):
    __slots__ = ("req_pool_idx", "start", "kv_locs", "token_ids")
    REQ_POOL_IDX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    KV_LOCS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    req_pool_idx: int
    start: int
    kv_locs: bytes
    token_ids: bytes
    def __init__(self, req_pool_idx: _Optional[int] = ..., start: _Optional[int] = ..., kv_locs: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class ForwardBatch(_message.Message):
    __slots__ = ("step", "forward_mode", "req_pool_indices", "prefix_lens", "extend_lens", "sample_mask", "input_ids", "positions", "out_cache_loc", "admissions", "slot_updates", "trace_context", "padded_batch_size", "split_layer_begin", "split_layer_end", "released_slots")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MODE_FIELD_NUMBER: _ClassVar[int]
    REQ_POOL_INDICES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_LENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MASK_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    OUT_CACHE_LOC_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PADDED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_END_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    forward_mode: ForwardMode
    req_pool_indices: bytes
    prefix_lens: bytes
    extend_lens: bytes
    sample_mask: bytes
    input_ids: bytes
    positions: bytes
    out_cache_loc: bytes
    admissions: _containers.RepeatedCompositeFieldContainer[ReqAdmission]
    slot_updates: _containers.RepeatedCompositeFieldContainer[SlotUpdate]
    trace_context: _containers.ScalarMap[str, str]
    padded_batch_size: int
    split_layer_begin: int
    split_layer_end: int
    released_slots: bytes
    def __init__(self, step: _Optional[int] = ..., forward_mode: _Optional[_Union[ForwardMode, str]] = ..., req_pool_indices: _Optional[bytes] = ..., prefix_lens: _Optional[bytes] = ..., extend_lens: _Optional[bytes] = ..., sample_mask: _Optional[bytes] = ..., input_ids: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., out_cache_loc: _Optional[bytes] = ..., admissions: _Optional[_Iterable[_Union[ReqAdmission, _Mapping]]] = ..., slot_updates: _Optional[_Iterable[_Union[SlotUpdate, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., padded_batch_size: _Optional[int] = ..., split_layer_begin: _Optional[int] = ..., split_layer_end: _Optional[int] = ..., released_slots: _Optional[bytes] = ...) -> None: ...

class ForwardResult(_message.Message):
    __slots__ = ("step", "next_token_ids", "logprobs", "top_logprob_ids", "top_logprob_values", "top_n", "forward_seconds", "cuda_graph_bucket", "accepted_lengths", "confidences")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_VALUES_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    step: int
    next_token_ids: bytes
    logprobs: bytes
    top_logprob_ids: bytes
    top_logprob_values: bytes
    top_n: int
    forward_seconds: float
    cuda_graph_bucket: int
    accepted_lengths: bytes
    confidences: bytes
    def __init__(self, step: _Optional[int] = ..., next_token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., top_logprob_ids: _Optional[bytes] = ..., top_logprob_values: _Optional[bytes] = ..., top_n: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., cuda_graph_bucket: _Optional[int] = ..., accepted_lengths: _Optional[bytes] = ..., confidences: _Optional[bytes] = ...) -> None: ...
