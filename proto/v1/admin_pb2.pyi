from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_STATE_UNSPECIFIED: _ClassVar[RankState]
    RANK_STATE_JOINING: _ClassVar[RankState]
    RANK_STATE_READY: _ClassVar[RankState]
    RANK_STATE_DRAINING: _ClassVar[RankState]
    RANK_STATE_DRAINED: _ClassVar[RankState]
    RANK_STATE_GONE: _ClassVar[RankState]
RANK_STATE_UNSPECIFIED: RankState
RANK_STATE_JOINING: RankState
RANK_STATE_READY: RankState
RANK_STATE_DRAINING: RankState
RANK_STATE_DRAINED: RankState
RANK_STATE_GONE: RankState

class RankSpec(_message.Message):
    __slots__ = ("rank", "address", "draining")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    draining: bool
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class SetRanksRequest(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankSpec]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankSpec, _Mapping]]] = ...) -> None: ...

class GetRanksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "address", "state", "requests", "load_tokens", "prefix_hit_tokens", "error")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    state: RankState
    requests: int
    load_tokens: int
    prefix_hit_tokens: int
    error: str
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., state: _Optional[_Union[RankState, str]] = ..., requests: _Optional[int] = ..., load_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class RanksStatus(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ...) -> None: ...
