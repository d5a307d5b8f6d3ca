"""The transport probe's checksum: every byte counts, words wrap modulo 2**64."""

from __future__ import annotations

import numpy as np

from workers.probe import byte_checksum


def reference(arr: np.ndarray) -> int:
    """The same definition, one word at a time in Python."""
    raw = arr.tobytes()
    raw += bytes(-len(raw) % 8)
    return sum(int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)) % 2**64


def test_checksum_matches_the_word_sum_for_sizes_with_and_without_a_tail() -> None:
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 8, 9, 1000, 4099):
        arr = rng.integers(0, 256, n, dtype=np.uint8)
        assert byte_checksum(arr) == reference(arr), n
    f = rng.random((33, 17), dtype=np.float32)  # 2,244 bytes: 280 words and a 4-byte tail
    assert byte_checksum(f) == reference(f)


def test_checksum_wraps_and_sees_a_single_changed_byte() -> None:
    big = np.full(4, 2**64 - 1, dtype=np.uint64)
    assert byte_checksum(big) == (4 * (2**64 - 1)) % 2**64
    arr = np.arange(100_000, dtype=np.float32)
    before = byte_checksum(arr)
    raw = arr.view(np.uint8)
    raw[123_457] ^= 1
    assert byte_checksum(arr) != before


def test_checksum_of_a_non_contiguous_view_is_that_of_its_values() -> None:
    arr = np.arange(64, dtype=np.int32).reshape(8, 8)
    assert byte_checksum(arr.T) == byte_checksum(np.ascontiguousarray(arr.T))
