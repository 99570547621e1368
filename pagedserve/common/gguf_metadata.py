"""The key-value metadata at the head of a GGUF file (llama.cpp's model format), without its tensors."""
import mmap
import struct
from pathlib import Path

# GGUF value types: the scalars by their struct format, then string and array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# v1 counted in 32 bits and predates every file still in use.
_VERSIONS = (2, 3)


class _Cursor:
    """Reads little-endian GGUF values one after another from a buffer."""

    def __init__(self, blob: mmap.mmap) -> None:
        self._blob = blob
        self._pos = 0

    def unpack(self, fmt: str) -> tuple:
        fmt = "<" + fmt
        values = struct.unpack_from(fmt, self._blob, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self._pos + length
        if end > len(self._blob):
            raise struct.error("string runs past the end of the file")
        text = self._blob[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"unknown GGUF value type {kind}")

    def array(self) -> list:
        kind, count = self.unpack("IQ")
        if kind in _SCALARS:
            return list(self.unpack(f"{count}{_SCALARS[kind]}"))
        return [self.value(kind) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict:
    """Every metadata key of a GGUF file with its value (arrays as lists); no tensor is read."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                return _read(_Cursor(blob), path)
            except struct.error as e:
                raise ValueError(f"{path} is truncated or corrupt: its metadata cannot be read ({e})") from e


def _read(cursor: _Cursor, path: str | Path) -> dict:
    cursor.unpack("4s")
    (version,) = cursor.unpack("I")
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 (little-endian) "
                         "can be read: convert it again with a current llama.cpp")
    _, count = cursor.unpack("QQ")
    metadata = {}
    for _ in range(count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("I")[0])
    return metadata
