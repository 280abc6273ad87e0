from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "block_size", "lora_name", "lora_digest", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    block_size: int
    lora_name: str
    lora_digest: str
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_digest: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("seq", "block_hashes", "instance_id", "host_block_hashes", "disk_block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    instance_id: str
    host_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    disk_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., instance_id: _Optional[str] = ..., host_block_hashes: _Optional[_Iterable[bytes]] = ..., disk_block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "snapshot", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    block_size: int
    snapshot: Snapshot
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("worker_id", "model", "role", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "block_size", "in_flight_tokens", "kv_cache_usage", "running_loras", "waiting_loras", "resident_loras", "max_loras", "lora_adapters", "lora_digests", "lora_instance", "lora_version", "prefill_s_per_token", "decode_step_s", "pending_prefill_tokens", "host_load_s_per_block", "disk_load_s_per_block", "peer_pull_s_per_block", "kv_block_bytes", "draining")
    class LoraDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORAS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    LORA_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LORA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DISK_LOAD_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PEER_PULL_S_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    in_flight_tokens: int
    kv_cache_usage: float
    running_loras: _containers.RepeatedScalarFieldContainer[str]
    waiting_loras: _containers.RepeatedScalarFieldContainer[str]
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_digests: _containers.ScalarMap[str, str]
    lora_instance: str
    lora_version: int
    prefill_s_per_token: float
    decode_step_s: float
    pending_prefill_tokens: int
    host_load_s_per_block: float
    disk_load_s_per_block: float
    peer_pull_s_per_block: float
    kv_block_bytes: int
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., in_flight_tokens: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., running_loras: _Optional[_Iterable[str]] = ..., waiting_loras: _Optional[_Iterable[str]] = ..., resident_loras: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_digests: _Optional[_Mapping[str, str]] = ..., lora_instance: _Optional[str] = ..., lora_version: _Optional[int] = ..., prefill_s_per_token: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., pending_prefill_tokens: _Optional[int] = ..., host_load_s_per_block: _Optional[float] = ..., disk_load_s_per_block: _Optional[float] = ..., peer_pull_s_per_block: _Optional[float] = ..., kv_block_bytes: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class TorchChannel(_message.Message):
    __slots__ = ("store_host", "store_port", "group_id", "tag")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    group_id: str
    tag: int
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., group_id: _Optional[str] = ..., tag: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "token_ids", "cache_salt", "block_size", "first_block", "num_blocks", "backend", "torch", "lease_s", "tail_tokens", "kv_cache_dtype", "lora_name", "lora_digest", "cached_only", "shm_node", "shm_segment", "shm_slot_bytes", "shm_slots", "shm_layer_batches")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CACHED_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHM_NODE_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SHM_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHM_LAYER_BATCHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    block_size: int
    first_block: int
    num_blocks: int
    backend: str
    torch: TorchChannel
    lease_s: float
    tail_tokens: int
    kv_cache_dtype: str
    lora_name: str
    lora_digest: str
    cached_only: bool
    shm_node: str
    shm_segment: str
    shm_slot_bytes: int
    shm_slots: int
    shm_layer_batches: bool
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., block_size: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., backend: _Optional[str] = ..., torch: _Optional[_Union[TorchChannel, _Mapping]] = ..., lease_s: _Optional[float] = ..., tail_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_digest: _Optional[str] = ..., cached_only: _Optional[bool] = ..., shm_node: _Optional[str] = ..., shm_segment: _Optional[str] = ..., shm_slot_bytes: _Optional[int] = ..., shm_slots: _Optional[int] = ..., shm_layer_batches: _Optional[bool] = ...) -> None: ...

class PageHeader(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "block_size", "head_dim", "dtype", "first_block", "block_hashes", "layer_bytes", "lease_id", "first_token", "tail_tokens", "kv_cache_dtype", "kv_page_format", "transport")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str
    first_block: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layer_bytes: int
    lease_id: str
    first_token: int
    tail_tokens: int
    kv_cache_dtype: str
    kv_page_format: int
    transport: str
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., block_size: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., first_block: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layer_bytes: _Optional[int] = ..., lease_id: _Optional[str] = ..., first_token: _Optional[int] = ..., tail_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_page_format: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class PageData(_message.Message):
    __slots__ = ("layer", "offset", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PageLayerEnd(_message.Message):
    __slots__ = ("layer", "xxh3_64")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    layer: int
    xxh3_64: int
    def __init__(self, layer: _Optional[int] = ..., xxh3_64: _Optional[int] = ...) -> None: ...

class PageTrailer(_message.Message):
    __slots__ = ("xxh3_64",)
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    xxh3_64: int
    def __init__(self, xxh3_64: _Optional[int] = ...) -> None: ...

class PageLayerEnds(_message.Message):
    __slots__ = ("ends",)
    ENDS_FIELD_NUMBER: _ClassVar[int]
    ends: _containers.RepeatedCompositeFieldContainer[PageLayerEnd]
    def __init__(self, ends: _Optional[_Iterable[_Union[PageLayerEnd, _Mapping]]] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("header", "data", "trailer", "layer_end", "layer_ends")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    LAYER_ENDS_FIELD_NUMBER: _ClassVar[int]
    header: PageHeader
    data: PageData
    trailer: PageTrailer
    layer_end: PageLayerEnd
    layer_ends: PageLayerEnds
    def __init__(self, header: _Optional[_Union[PageHeader, _Mapping]] = ..., data: _Optional[_Union[PageData, _Mapping]] = ..., trailer: _Optional[_Union[PageTrailer, _Mapping]] = ..., layer_end: _Optional[_Union[PageLayerEnd, _Mapping]] = ..., layer_ends: _Optional[_Union[PageLayerEnds, _Mapping]] = ...) -> None: ...

class ReleasePagesRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleasePagesResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
