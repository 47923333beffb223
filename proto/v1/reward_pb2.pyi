from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("item_id", "domain", "prompt", "response", "reference", "metadata", "image")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    domain: str
    prompt: str
    response: str
    reference: str
    metadata: _struct_pb2.Struct
    image: bytes
    def __init__(self, item_id: _Optional[str] = ..., domain: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., reference: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., image: _Optional[bytes] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "item_timeout_seconds")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ITEM_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    item_timeout_seconds: float
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., item_timeout_seconds: _Optional[float] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("item_id", "reward", "components", "error", "error_message")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    reward: float
    components: _containers.ScalarMap[str, float]
    error: bool
    error_message: str
    def __init__(self, item_id: _Optional[str] = ..., reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., error: _Optional[bool] = ..., error_message: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ListScorersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScorerInfo(_message.Message):
    __slots__ = ("domain", "scorer", "description")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    domain: str
    scorer: str
    description: str
    def __init__(self, domain: _Optional[str] = ..., scorer: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class ListScorersResponse(_message.Message):
    __slots__ = ("scorers", "parallel_items", "item_timeout_seconds")
    SCORERS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ITEM_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    scorers: _containers.RepeatedCompositeFieldContainer[ScorerInfo]
    parallel_items: int
    item_timeout_seconds: float
    def __init__(self, scorers: _Optional[_Iterable[_Union[ScorerInfo, _Mapping]]] = ..., parallel_items: _Optional[int] = ..., item_timeout_seconds: _Optional[float] = ...) -> None: ...
