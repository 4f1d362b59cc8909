from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_timeout_ms", "prefill_locally")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_timeout_ms: int
    prefill_locally: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_timeout_ms: _Optional[int] = ..., prefill_locally: _Optional[bool] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("transfer_id", "kv_address", "block_ids", "deadline_unix_ms", "compat_hash", "num_cached_blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    kv_address: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_unix_ms: int
    compat_hash: str
    num_cached_blocks: int
    def __init__(self, transfer_id: _Optional[str] = ..., kv_address: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., deadline_unix_ms: _Optional[int] = ..., compat_hash: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("destination",)
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    destination: KVDestination
    def __init__(self, destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "cached_prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    cached_prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("admitted", "tokens")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    tokens: TokenChunk
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "decode_idle", "cache_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_IDLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    destination: KVDestination
    decode_idle: bool
    cache_only: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., decode_idle: _Optional[bool] = ..., cache_only: _Optional[bool] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes", "seconds", "gbps", "overlap_fraction")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    gbps: float
    overlap_fraction: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., gbps: _Optional[float] = ..., overlap_fraction: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "cached_prompt_tokens", "transfer")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    first_token: _common_pb2.TokenLogprob
    cached_prompt_tokens: int
    transfer: TransferStats
    def __init__(self, first_token: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("num_total_blocks", "num_free_blocks", "num_running", "num_waiting", "outstanding_tokens", "engine_steps", "engine_busy_s", "engine_step_predicted_s", "prefill_queue_s", "prefill_token_s", "prefix_summary")
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEP_PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    outstanding_tokens: int
    engine_steps: int
    engine_busy_s: float
    engine_step_predicted_s: float
    prefill_queue_s: float
    prefill_token_s: float
    prefix_summary: PrefixSummary
    def __init__(self, num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., engine_steps: _Optional[int] = ..., engine_busy_s: _Optional[float] = ..., engine_step_predicted_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_token_s: _Optional[float] = ..., prefix_summary: _Optional[_Union[PrefixSummary, _Mapping]] = ...) -> None: ...

class PrefixSummary(_message.Message):
    __slots__ = ("block_size", "num_hashes", "num_probes", "bloom")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROBES_FIELD_NUMBER: _ClassVar[int]
    BLOOM_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_hashes: int
    num_probes: int
    bloom: bytes
    def __init__(self, block_size: _Optional[int] = ..., num_hashes: _Optional[int] = ..., num_probes: _Optional[int] = ..., bloom: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    layout: _common_pb2.KVLayout
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "stats")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    stats: WorkerStats
    def __init__(self, worker_id: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
