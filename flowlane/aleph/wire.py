"""ALEPH's wire header and int32 fixed-point codec, shared with the C data plane (``aleph_dataplane/include/
aleph_wire.h``; tests pin the two together by parsing the header).

Fixed point (digest §5.2 #1; eBPF has no floating point, so every tier sums integers): a bucket of floats x is
sent as round(x * 2^k) in int32 with one exponent k per bucket and iteration, chosen from the bucket's global
max-abs M so that n contributions cannot overflow: |round(x * 2^k)| <= 2^(30 - ceil(log2 n)), so a sum of n stays
below 2^30 < 2^31 (ceil(log2 n) headroom bits, as SwitchML/ATP do). The sum is decoded as int / 2^k. Integer
inputs (k = 0) are summed exactly.
"""

from __future__ import annotations

import math
import struct

import numpy as np

MAGIC = 0xA1E9
VERSION = 1
SEG_ELEMS = 128
MAX_CHILDREN = 32
NACK_SPAN = 32
DATA, RESULT, NACK, RETX = 1, 2, 3, 4
# magic version type job src iteration segment bitmap scale flags count
HEADER = struct.Struct("<HBBHHIIIbBH")
SCALE_MIN, SCALE_MAX = -100, 100


def pack(
    type_: int,
    iteration: int,
    segment: int,
    values: np.ndarray | None = None,
    *,
    job: int = 0,
    src: int = 0,
    bitmap: int | None = None,
    scale: int = 0,
    flags: int = 0,
    count: int | None = None,
    magic: int = MAGIC,
    version: int = VERSION,
) -> bytes:
    """One datagram; every field can be set (tests craft bad packets with it)."""
    vals = np.zeros(0, np.int32) if values is None else np.ascontiguousarray(values, dtype="<i4")
    bitmap = (
        (1 << src if type_ == DATA else 0xFFFFFFFF if type_ == RESULT else 0) if bitmap is None else bitmap
    )
    count = vals.size if count is None else count
    return (
        HEADER.pack(magic, version, type_, job, src, iteration, segment, bitmap, scale, flags, count)
        + vals.tobytes()
    )


def unpack(buf: bytes) -> tuple[tuple[int, ...], np.ndarray]:
    """(header fields, int32 payload) of a datagram (no checks: the C side is the one facing the network)."""
    fields = HEADER.unpack_from(buf)
    return fields, np.frombuffer(buf[HEADER.size :], dtype="<i4")


def scale_exponent(max_abs: float, n: int) -> int:
    """k for a bucket whose global max-abs is ``max_abs`` summed over ``n`` contributors (see the module doc)."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n={n!r} must be an integer >= 1 (the number of contributions)")
    if not (math.isfinite(max_abs) and max_abs >= 0):
        raise ValueError(
            f"max_abs={max_abs!r} must be finite and >= 0 (a NaN/inf gradient cannot be fixed-point)"
        )
    if max_abs == 0:
        return 0
    k = 30 - math.ceil(math.log2(n)) - math.ceil(math.log2(max_abs))
    if max_abs * 2.0**k > 2.0 ** (30 - math.ceil(math.log2(n))):  # log2 rounding at exact powers of two
        k -= 1
    return max(SCALE_MIN, min(SCALE_MAX, k))


def encode(x: np.ndarray, k: int) -> np.ndarray:
    """round(x * 2^k) as int32; refuses NaN/inf (int32 has no code for them: the cast would give INT32_MIN) and values
    that would not fit (the exponent was chosen too large)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size and not np.isfinite(x).all():
        bad = x[~np.isfinite(x)]
        raise ValueError(
            f"{bad.size} non-finite value(s) (first {float(bad[0])!r}) cannot be fixed-point: a NaN/inf gradient has "
            "no int32 code; check for it before encoding (UdpAllReduce returns NaN on every rank then)"
        )
    y = np.rint(x * 2.0**k)
    if y.size and np.abs(y).max() > 2**31 - 1:
        raise ValueError(
            f"values up to {float(np.abs(x).max())} do not fit int32 at scale 2^{k}; choose k with "
            f"scale_exponent(global max-abs, n)"
        )
    return y.astype(np.int32)


def decode(s: np.ndarray, k: int) -> np.ndarray:
    """A fixed-point sum back to float64: s / 2^k."""
    return np.asarray(s, dtype=np.float64) / 2.0**k
