"""crc32c of a whole object from the crc32c of its parts, read separately and in any order.

The reshard executor reads each source chunk as several byte ranges (one per destination
object that needs it, possibly on different threads or torchrun workers) and never holds
the whole chunk.  It still verifies the chunk's recorded crc32c: crc32c is affine over
GF(2), so ``crc(A || B) = crc(B) ^ Z(len(B), crc(A))`` where ``Z(n, .)`` is the linear map
"append n zero bytes" (without the constant term).  ``Z(n, .)`` is a 32x32 bit matrix,
built once for every power of two from one zero byte and applied in O(log n).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ckptd.format.checksum import crc32c_zeros

_LOCK = threading.Lock()
_POW2: list[list[int]] = []  # _POW2[k]: columns of the matrix "append 2**k zero bytes"


def _apply(cols: list[int], v: int) -> int:
    out = 0
    i = 0
    while v:
        if v & 1:
            out ^= cols[i]
        v >>= 1
        i += 1
    return out


def _square(cols: list[int]) -> list[int]:
    return [_apply(cols, c) for c in cols]


def _matrices(k: int) -> list[list[int]]:
    with _LOCK:
        if not _POW2:
            base = crc32c_zeros(1, 0)
            _POW2.append([crc32c_zeros(1, 1 << i) ^ base for i in range(32)])
        while len(_POW2) <= k:
            _POW2.append(_square(_POW2[-1]))
        return _POW2


def shift(crc: int, n: int) -> int:
    """The linear part of extending a crc32c by ``n`` zero bytes."""
    if n <= 0 or crc == 0:
        return 0 if n > 0 else crc
    mats = _matrices(n.bit_length())
    k = 0
    while n:
        if n & 1:
            crc = _apply(mats[k], crc)
        n >>= 1
        k += 1
    return crc


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of ``A || B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    if len_b == 0:
        return crc_a
    return crc_b ^ shift(crc_a, len_b)


def combine_parts(parts: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """Combine ``(offset, length, crc32c)`` parts sorted by offset; returns (crc, end).

    The parts must be contiguous from offset 0 (the caller checks coverage first).
    """
    crc = 0
    end = 0
    for off, n, c in parts:
        if off != end:
            raise ValueError(f"parts are not contiguous: expected offset {end}, got {off}")
        crc = combine(crc, c, n)
        end += n
    return crc, end
