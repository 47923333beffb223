from rollwire.proto.v1 import env_pb2 as _env_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class DenoiseRequest(_message.Message):
    __slots__ = ("request_id", "latents", "times", "labels", "guidance")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    latents: bytes
    times: _containers.RepeatedScalarFieldContainer[float]
    labels: _containers.RepeatedScalarFieldContainer[int]
    guidance: float
    def __init__(self, request_id: _Optional[str] = ..., latents: _Optional[bytes] = ..., times: _Optional[_Iterable[float]] = ..., labels: _Optional[_Iterable[int]] = ..., guidance: _Optional[float] = ...) -> None: ...

class DenoiseResponse(_message.Message):
    __slots__ = ("clean", "policy_version", "seconds")
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    clean: bytes
    policy_version: int
    seconds: float
    def __init__(self, clean: _Optional[bytes] = ..., policy_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ImageSampling(_message.Message):
    __slots__ = ("steps", "eta", "sde_first", "sde_last", "shift", "guidance")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    SDE_FIRST_FIELD_NUMBER: _ClassVar[int]
    SDE_LAST_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    steps: int
    eta: float
    sde_first: int
    sde_last: int
    shift: float
    guidance: float
    def __init__(self, steps: _Optional[int] = ..., eta: _Optional[float] = ..., sde_first: _Optional[int] = ..., sde_last: _Optional[int] = ..., shift: _Optional[float] = ..., guidance: _Optional[float] = ...) -> None: ...

class GenerateImagesRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "seeds", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedScalarFieldContainer[str]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    sampling: ImageSampling
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[str]] = ..., seeds: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ImageSampling, _Mapping]] = ...) -> None: ...

class ImageSample(_message.Message):
    __slots__ = ("request_id", "image", "latents", "recorded_steps", "logprobs", "policy_versions", "label", "finish_reason", "policy_version", "queue_seconds", "generate_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    RECORDED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    image: bytes
    latents: bytes
    recorded_steps: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    label: int
    finish_reason: FinishReason
    policy_version: int
    queue_seconds: float
    generate_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., image: _Optional[bytes] = ..., latents: _Optional[bytes] = ..., recorded_steps: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., label: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., generate_seconds: _Optional[float] = ...) -> None: ...

class GenerateImagesResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[ImageSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[ImageSample, _Mapping]]] = ...) -> None: ...

class SetThreadsRequest(_message.Message):
    __slots__ = ("threads",)
    THREADS_FIELD_NUMBER: _ClassVar[int]
    threads: int
    def __init__(self, threads: _Optional[int] = ...) -> None: ...

class SetThreadsResponse(_message.Message):
    __slots__ = ("applied", "threads", "reason")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    threads: int
    reason: str
    def __init__(self, applied: _Optional[bool] = ..., threads: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    images: _containers.RepeatedCompositeFieldContainer[_env_pb2.Image]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_env_pb2.Image, _Mapping]]] = ...) -> None: ...

class GenerateGroupRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "num_samples", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_samples: int
    images: _containers.RepeatedCompositeFieldContainer[_env_pb2.Image]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_env_pb2.Image, _Mapping]]] = ...) -> None: ...

class GenerateGroupResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, samples: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "policy_versions", "finish_reason", "policy_version", "queue_seconds", "generate_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    policy_version: int
    queue_seconds: float
    generate_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., generate_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "all")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    all: bool
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., all: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "name", "dtype", "shape", "offset", "data", "total_bytes", "base_version", "encoding", "sha256", "keep_base", "lora_rank", "lora_scaling")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KEEP_BASE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_SCALING_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    total_bytes: int
    base_version: int
    encoding: str
    sha256: bytes
    keep_base: bool
    lora_rank: int
    lora_scaling: float
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., base_version: _Optional[int] = ..., encoding: _Optional[str] = ..., sha256: _Optional[bytes] = ..., keep_base: _Optional[bool] = ..., lora_rank: _Optional[int] = ..., lora_scaling: _Optional[float] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes_received", "tensors", "apply_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_received: int
    tensors: int
    apply_seconds: float
    def __init__(self, version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., tensors: _Optional[int] = ..., apply_seconds: _Optional[float] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("policy_version", "engine", "model", "running_requests", "waiting_requests", "generated_tokens", "tokenizer_digest", "threads")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    engine: str
    model: str
    running_requests: int
    waiting_requests: int
    generated_tokens: int
    tokenizer_digest: str
    threads: int
    def __init__(self, policy_version: _Optional[int] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., threads: _Optional[int] = ...) -> None: ...

class JoinWeightGroupRequest(_message.Message):
    __slots__ = ("address", "port", "rank", "world_size", "backend", "group_id", "timeout_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    rank: int
    world_size: int
    backend: str
    group_id: str
    timeout_seconds: float
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., group_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class JoinWeightGroupResponse(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("version", "group_id", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    group_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, version: _Optional[int] = ..., group_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids", "start", "images")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start: int
    images: _containers.RepeatedCompositeFieldContainer[_env_pb2.Image]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_env_pb2.Image, _Mapping]]] = ...) -> None: ...

class ScoreTokensRequest(_message.Message):
    __slots__ = ("request_id", "sequences", "top_k")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    top_k: int
    def __init__(self, request_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class SequenceScores(_message.Message):
    __slots__ = ("logprobs", "top_token_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("sequences", "policy_version")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceScores]
    policy_version: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceScores, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...
