from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transfer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_UNSPECIFIED: _ClassVar[Transfer]
    TRANSFER_SHARED_MEMORY: _ClassVar[Transfer]
    TRANSFER_STREAM: _ClassVar[Transfer]

class SegmentUse(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_USE_SAVE: _ClassVar[SegmentUse]
    SEGMENT_USE_READ: _ClassVar[SegmentUse]

class SaveState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_STATE_UNSPECIFIED: _ClassVar[SaveState]
    SAVE_STATE_ACCEPTED: _ClassVar[SaveState]
    SAVE_STATE_WRITTEN: _ClassVar[SaveState]
    SAVE_STATE_COMMITTED: _ClassVar[SaveState]
    SAVE_STATE_FAILED: _ClassVar[SaveState]
TRANSFER_UNSPECIFIED: Transfer
TRANSFER_SHARED_MEMORY: Transfer
TRANSFER_STREAM: Transfer
SEGMENT_USE_SAVE: SegmentUse
SEGMENT_USE_READ: SegmentUse
SAVE_STATE_UNSPECIFIED: SaveState
SAVE_STATE_ACCEPTED: SaveState
SAVE_STATE_WRITTEN: SaveState
SAVE_STATE_COMMITTED: SaveState
SAVE_STATE_FAILED: SaveState

class RegisterRankRequest(_message.Message):
    __slots__ = ("job", "rank", "world_size", "pid", "hostname")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    pid: int
    hostname: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ...) -> None: ...

class RegisterRankResponse(_message.Message):
    __slots__ = ("session_id", "session_secret", "fd_socket", "staging_budget_bytes", "max_message_bytes", "daemon_version", "storage_url")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORAGE_URL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: bytes
    fd_socket: str
    staging_budget_bytes: int
    max_message_bytes: int
    daemon_version: str
    storage_url: str
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[bytes] = ..., fd_socket: _Optional[str] = ..., staging_budget_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., daemon_version: _Optional[str] = ..., storage_url: _Optional[str] = ...) -> None: ...

class AcquireStagingRequest(_message.Message):
    __slots__ = ("session_id", "nbytes", "wait", "transfer", "use")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    USE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nbytes: int
    wait: bool
    transfer: Transfer
    use: SegmentUse
    def __init__(self, session_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., wait: _Optional[bool] = ..., transfer: _Optional[_Union[Transfer, str]] = ..., use: _Optional[_Union[SegmentUse, str]] = ...) -> None: ...

class AcquireStagingResponse(_message.Message):
    __slots__ = ("segment_id", "size")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    size: int
    def __init__(self, segment_id: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ReleaseStagingRequest(_message.Message):
    __slots__ = ("session_id", "segment_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    segment_id: str
    def __init__(self, session_id: _Optional[str] = ..., segment_id: _Optional[str] = ...) -> None: ...

class ReleaseStagingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveIdentity(_message.Message):
    __slots__ = ("job", "step", "attempt", "rank", "world_size", "framework")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    attempt: str
    rank: int
    world_size: int
    framework: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., framework: _Optional[str] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("session_id", "segment_id", "identity", "plan_json", "extra_json", "param_groups_json", "commit_timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAM_GROUPS_JSON_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    segment_id: str
    identity: SaveIdentity
    plan_json: bytes
    extra_json: bytes
    param_groups_json: bytes
    commit_timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., segment_id: _Optional[str] = ..., identity: _Optional[_Union[SaveIdentity, _Mapping]] = ..., plan_json: _Optional[bytes] = ..., extra_json: _Optional[bytes] = ..., param_groups_json: _Optional[bytes] = ..., commit_timeout_s: _Optional[float] = ...) -> None: ...

class AbandonSaveRequest(_message.Message):
    __slots__ = ("session_id", "identity", "error_message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    identity: SaveIdentity
    error_message: str
    def __init__(self, session_id: _Optional[str] = ..., identity: _Optional[_Union[SaveIdentity, _Mapping]] = ..., error_message: _Optional[str] = ...) -> None: ...

class AbandonSaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveStreamRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SaveRequest
    data: bytes
    def __init__(self, header: _Optional[_Union[SaveRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("save_id", "state")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    state: SaveState
    def __init__(self, save_id: _Optional[str] = ..., state: _Optional[_Union[SaveState, str]] = ...) -> None: ...

class SaveStatus(_message.Message):
    __slots__ = ("save_id", "state", "segment_returned", "nbytes", "error_class", "error_message", "world_size")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_RETURNED_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    state: SaveState
    segment_returned: bool
    nbytes: int
    error_class: str
    error_message: str
    world_size: int
    def __init__(self, save_id: _Optional[str] = ..., state: _Optional[_Union[SaveState, str]] = ..., segment_returned: _Optional[bool] = ..., nbytes: _Optional[int] = ..., error_class: _Optional[str] = ..., error_message: _Optional[str] = ..., world_size: _Optional[int] = ...) -> None: ...

class GetSaveStatusRequest(_message.Message):
    __slots__ = ("save_id",)
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    def __init__(self, save_id: _Optional[str] = ...) -> None: ...

class WatchSaveRequest(_message.Message):
    __slots__ = ("save_id", "identity", "commit_timeout_s")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    save_id: str
    identity: SaveIdentity
    commit_timeout_s: float
    def __init__(self, save_id: _Optional[str] = ..., identity: _Optional[_Union[SaveIdentity, _Mapping]] = ..., commit_timeout_s: _Optional[float] = ...) -> None: ...

class ListStepsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("step", "committed", "attempt", "world_size", "attempts")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed: bool
    attempt: str
    world_size: int
    attempts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., committed: _Optional[bool] = ..., attempt: _Optional[str] = ..., world_size: _Optional[int] = ..., attempts: _Optional[_Iterable[str]] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepInfo]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepInfo, _Mapping]]] = ...) -> None: ...

class StatObjectRequest(_message.Message):
    __slots__ = ("job", "key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class StatObjectResponse(_message.Message):
    __slots__ = ("exists", "size")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    size: int
    def __init__(self, exists: _Optional[bool] = ..., size: _Optional[int] = ...) -> None: ...

class ListObjectsRequest(_message.Message):
    __slots__ = ("job", "prefix", "recursive")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    job: str
    prefix: str
    recursive: bool
    def __init__(self, job: _Optional[str] = ..., prefix: _Optional[str] = ..., recursive: _Optional[bool] = ...) -> None: ...

class ListObjectsResponse(_message.Message):
    __slots__ = ("names", "sizes")
    class SizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.ScalarMap[str, int]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ReadObjectRequest(_message.Message):
    __slots__ = ("job", "key", "start", "end")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    job: str
    key: str
    start: int
    end: int
    def __init__(self, job: _Optional[str] = ..., key: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ReadObjectResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ReadRange(_message.Message):
    __slots__ = ("key", "start", "length", "offset", "whole")
    KEY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    key: str
    start: int
    length: int
    offset: int
    whole: bool
    def __init__(self, key: _Optional[str] = ..., start: _Optional[int] = ..., length: _Optional[int] = ..., offset: _Optional[int] = ..., whole: _Optional[bool] = ...) -> None: ...

class ReadIntoSegmentRequest(_message.Message):
    __slots__ = ("session_id", "segment_id", "ranges")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    segment_id: str
    ranges: _containers.RepeatedCompositeFieldContainer[ReadRange]
    def __init__(self, session_id: _Optional[str] = ..., segment_id: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[ReadRange, _Mapping]]] = ...) -> None: ...

class ReadIntoSegmentResponse(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, nbytes: _Optional[_Iterable[int]] = ...) -> None: ...
