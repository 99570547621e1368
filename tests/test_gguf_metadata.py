"""Crafted GGUF headers fail with a ValueError that names the field, within bounded memory: the
gateway parses the model's header too, so a bad file must not take it down."""
import struct
import tracemalloc
from array import array

import pytest

from pagedserve.common import gguf_metadata
from pagedserve.common.gguf_metadata import read_gguf_header, read_gguf_metadata

UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


def string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def entry(key: str, kind: int, value: bytes) -> bytes:
    return string(key) + struct.pack("<I", kind) + value


def write(path, *entries: bytes, n_tensors: int = 0, tensors: bytes = b"") -> str:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(entries)) + b"".join(entries) + tensors
                     + bytes(64))
    return str(path)


def one_tensor() -> bytes:
    # name, one dimension of 4, F32, offset 0
    return string("w") + struct.pack("<IQIQ", 1, 4, 0, 0)


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_an_alignment_that_is_not_a_power_of_two_is_named(tmp_path, alignment):
    path = write(tmp_path / "a.gguf", entry("general.alignment", UINT32, struct.pack("<I", alignment)),
                 n_tensors=1, tensors=one_tensor())
    with pytest.raises(ValueError, match=f"general.alignment is {alignment}, not a power of two"):
        read_gguf_header(path)


def test_deeply_nested_arrays_are_refused_with_their_key(tmp_path):
    nested = struct.pack("<IQ", UINT8, 0)
    for _ in range(5000):
        nested = struct.pack("<IQ", ARRAY, 1) + nested
    path = write(tmp_path / "n.gguf", entry("general.deep", ARRAY, nested))
    with pytest.raises(ValueError, match="metadata key general.deep nests arrays more than 4 deep"):
        read_gguf_metadata(path)


def test_a_huge_string_array_count_is_refused_before_any_is_read(tmp_path):
    path = write(tmp_path / "c.gguf", entry("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2**40)))
    with pytest.raises(ValueError, match="metadata key tokenizer.ggml.tokens makes the metadata hold more"):
        read_gguf_metadata(path)


def test_metadata_past_its_byte_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_metadata, "MAX_METADATA_BYTES", 2**20)
    path = write(tmp_path / "b.gguf", entry("general.name", STRING, string("x" * 2**20)))
    with pytest.raises(ValueError, match="metadata key general.name runs past 1 MiB of metadata"):
        read_gguf_metadata(path)


def test_a_numeric_array_stays_packed(tmp_path):
    """8 MB of uint8 costs about its own size, not a Python object per element (a list: 64 MB+)."""
    n = 8 * 2**20
    path = write(tmp_path / "p.gguf", entry("tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", UINT8, n)
                                            + bytes(range(256)) * (n // 256)))
    tracemalloc.start()
    try:
        values = read_gguf_metadata(path)["tokenizer.ggml.token_type"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(values, array) and len(values) == n and values[257] == 1
    assert peak < 3 * n
