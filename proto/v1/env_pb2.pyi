from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvSpec(_message.Message):
    __slots__ = ("env_id", "description", "domain", "gives_reward")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    GIVES_REWARD_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    description: str
    domain: str
    gives_reward: bool
    def __init__(self, env_id: _Optional[str] = ..., description: _Optional[str] = ..., domain: _Optional[str] = ..., gives_reward: _Optional[bool] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "format", "uri")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: str
    uri: str
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[str] = ..., uri: _Optional[str] = ...) -> None: ...

class ListEnvsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("envs",)
    ENVS_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedCompositeFieldContainer[EnvSpec]
    def __init__(self, envs: _Optional[_Iterable[_Union[EnvSpec, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env_id", "seed", "env_kwargs")
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ENV_KWARGS_FIELD_NUMBER: _ClassVar[int]
    env_id: str
    seed: int
    env_kwargs: _struct_pb2.Struct
    def __init__(self, env_id: _Optional[str] = ..., seed: _Optional[int] = ..., env_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "observation", "info", "images")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation: str
    info: _struct_pb2.Struct
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, session_id: _Optional[str] = ..., observation: _Optional[str] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "terminated", "truncated", "info", "images")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: _struct_pb2.Struct
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class EnvCall(_message.Message):
    __slots__ = ("call_id", "reset", "step", "close")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    reset: ResetRequest
    step: StepRequest
    close: CloseRequest
    def __init__(self, call_id: _Optional[int] = ..., reset: _Optional[_Union[ResetRequest, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ..., close: _Optional[_Union[CloseRequest, _Mapping]] = ...) -> None: ...

class EnvCallBatch(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[EnvCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[EnvCall, _Mapping]]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EnvReply(_message.Message):
    __slots__ = ("call_id", "reset", "step", "close", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    reset: ResetResponse
    step: StepResponse
    close: CloseResponse
    error: CallError
    def __init__(self, call_id: _Optional[int] = ..., reset: _Optional[_Union[ResetResponse, _Mapping]] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ..., close: _Optional[_Union[CloseResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class EnvReplyBatch(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[EnvReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[EnvReply, _Mapping]]] = ...) -> None: ...
