"""The header of a GGUF file (llama.cpp's model format): its key-value metadata and the table of
its tensors, without reading any tensor's data. A model file is trusted input, but the gateway
parses the same header, so a crafted one must fail with a ValueError, not take the process down."""
import math
from array import array
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

# GGUF value types: the scalars by their struct format, then string and array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# v1 counted in 32 bits and predates every file still in use.
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_LENGTH = struct.Struct("<Q")
# Numeric arrays (token types, scores) stay packed at the file's width, as array.array: a list holds
# an object per element, ~14x the file's bytes (a 50 MB uint8 array took 715 MB). Bools stay lists.
_PACKED = {kind: fmt for kind, fmt in _SCALARS.items() if fmt != "?"}
# Bounds far past any real model's: the largest vocabularies (262k tokens, or 128k and 280k merges)
# take under 10 MB and a million strings; a deeper nesting than an array of arrays is unheard of.
MAX_METADATA_BYTES = 64 * 2**20
MAX_METADATA_OBJECTS = 2**21
MAX_ARRAY_DEPTH = 4

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class GGUFTensorInfo:
    """Where one tensor's data lies in its file, and how to read it."""
    name: str
    shape: tuple[int, ...]  # numpy's order, outermost first (GGUF lists ggml's ne, innermost first)
    ggml_type: "GGMLQuantizationType"
    offset: int  # from the start of the file
    n_bytes: int


@dataclass(slots=True, frozen=True)
class GGUFHeader:
    metadata: dict
    tensors: list[GGUFTensorInfo]


class _TooLarge(Exception):
    """A metadata value past one of the bounds above; the message says which."""


class _Cursor:
    """Reads little-endian GGUF values one after another from a buffer; until the metadata is read
    (`limit` is then lifted), strings and arrays end within MAX_METADATA_BYTES and make at most
    MAX_METADATA_OBJECTS objects."""

    def __init__(self, blob: mmap.mmap) -> None:
        self.blob = blob
        self.pos = 0
        self.limit = MAX_METADATA_BYTES
        self.objects_left = MAX_METADATA_OBJECTS

    def unpack(self, fmt: str) -> tuple:
        fmt = "<" + fmt
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        # Vocabularies hold ~10^5 strings: the length's format is compiled once.
        (length,) = _LENGTH.unpack_from(self.blob, self.pos)
        start = self.pos + _LENGTH.size
        end = start + length
        self._check_end(end, "string")
        text = self.blob[start:end].decode("utf-8")
        self.pos = end
        return text

    def _check_end(self, end: int, what: str) -> None:
        if end > len(self.blob):
            raise struct.error(f"{what} runs past the end of the file")
        if end > self.limit:
            raise _TooLarge(f"runs past {self.limit // 2**20} MiB of metadata")

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(depth + 1)
        raise ValueError(f"unknown GGUF value type {kind}")

    def array(self, depth: int) -> list | array:
        if depth > MAX_ARRAY_DEPTH:
            raise _TooLarge(f"nests arrays more than {MAX_ARRAY_DEPTH} deep")
        kind, count = self.unpack("IQ")
        if kind in _PACKED:
            return self.packed(_PACKED[kind], count)
        self.objects_left -= count
        if self.objects_left < 0:
            raise _TooLarge(f"makes the metadata hold more than {MAX_METADATA_OBJECTS} strings and arrays")
        if kind == _STRING:
            return [self.string() for _ in range(count)]
        return [self.value(kind, depth) for _ in range(count)]

    def packed(self, fmt: str, count: int) -> array:
        values = array(fmt)
        end = self.pos + count * values.itemsize
        self._check_end(end, "array")
        values.frombytes(self.blob[self.pos:end])
        self.pos = end
        return values


def read_gguf_metadata(path: str | Path) -> dict:
    """Every metadata key of a GGUF file with its value (numeric arrays as array.array, the others as
    lists); no tensor is read."""
    return _parse(path, lambda cursor: _key_values(cursor, _counts(cursor, path)[1], path))


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata of a GGUF file and the table of its tensors, in the file's order."""
    return _parse(path, lambda cursor: _header(cursor, path))


def _parse(path: str | Path, read: Callable[[_Cursor], T]) -> T:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                return read(_Cursor(blob))
            except struct.error as e:
                raise ValueError(f"{path} is truncated or corrupt: its header cannot be read ({e})") from e


def _counts(cursor: _Cursor, path: str | Path) -> tuple[int, int]:
    cursor.unpack("4s")
    (version,) = cursor.unpack("I")
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 (little-endian) "
                         "can be read: convert it again with a current llama.cpp")
    return cursor.unpack("QQ")


def _key_values(cursor: _Cursor, count: int, path: str | Path) -> dict:
    metadata = {}
    key = "(the first)"
    try:
        for _ in range(count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("I")[0])
    except _TooLarge as e:
        raise ValueError(f"{path}: metadata key {key} {e}; the file is corrupt or crafted") from None
    cursor.limit = len(cursor.blob)
    return metadata


def _header(cursor: _Cursor, path: str | Path) -> GGUFHeader:
    n_tensors, n_key_values = _counts(cursor, path)
    metadata = _key_values(cursor, n_key_values, path)
    entries = [_tensor_entry(cursor) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment is {alignment!r}, not a power of two; llama.cpp writes "
                         f"{_DEFAULT_ALIGNMENT}: convert the model again")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [_tensor_info(path, data_start, *entry) for entry in entries]
    _check_tensors(path, tensors, len(cursor.blob))
    return GGUFHeader(metadata, tensors)


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    (n_dims,) = cursor.unpack("I")
    dims = cursor.unpack(f"{n_dims}Q")
    ggml_type, offset = cursor.unpack("IQ")
    return name, dims, ggml_type, offset


def _tensor_info(path: str | Path, data_start: int, name: str, dims: tuple[int, ...], ggml_type: int,
                 offset: int) -> GGUFTensorInfo:
    # Imported here: the tokenizer (the gateway's only reader) needs no tensor, numpy nor gguf.
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise ValueError(f"GGUF tensor {name} in {path} has ggml type {ggml_type}, which the gguf "
                         "package does not know: upgrade gguf or convert the model again") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return GGUFTensorInfo(name, tuple(reversed(dims)), qtype, data_start + offset,
                          math.prod(dims) * type_size // block_size)


def _check_tensors(path: str | Path, tensors: list[GGUFTensorInfo], file_size: int) -> None:
    names = set()
    for tensor in tensors:
        if tensor.name in names:
            raise ValueError(f"{path} holds two tensors named {tensor.name}: convert the model again")
        if tensor.offset + tensor.n_bytes > file_size:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} runs past the end of the file")
        names.add(tensor.name)
