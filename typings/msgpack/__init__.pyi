# The part of msgpack's API hivenode uses; msgpack ships no type information. packb returns bytes; what
# unpackb returns is untrusted wire data, so it stays Any and every caller validates it.
from collections.abc import Callable
from typing import Any

class UnpackException(Exception): ...
class FormatError(ValueError, UnpackException): ...
class StackError(ValueError, UnpackException): ...

class ExtraData(ValueError):
    unpacked: Any
    extra: bytes

def packb(
    o: Any,
    *,
    default: Callable[[Any], Any] | None = ...,
    use_single_float: bool = ...,
    autoreset: bool = ...,
    use_bin_type: bool = ...,
    strict_types: bool = ...,
    datetime: bool = ...,
    unicode_errors: str | None = ...,
) -> bytes: ...
def unpackb(
    packed: bytes | bytearray | memoryview,
    *,
    raw: bool = ...,
    use_list: bool = ...,
    timestamp: int = ...,
    strict_map_key: bool = ...,
    object_hook: Callable[[dict[Any, Any]], Any] | None = ...,
    object_pairs_hook: Callable[[list[tuple[Any, Any]]], Any] | None = ...,
    list_hook: Callable[[list[Any]], Any] | None = ...,
    unicode_errors: str | None = ...,
    max_buffer_size: int = ...,
    ext_hook: Callable[[int, bytes], Any] = ...,
    max_str_len: int = ...,
    max_bin_len: int = ...,
    max_array_len: int = ...,
    max_map_len: int = ...,
    max_ext_len: int = ...,
) -> Any: ...
