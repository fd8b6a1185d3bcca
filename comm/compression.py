"""fp16 compression: float16 on the wire, float32 partial sums.

With ``compression="fp16"`` every value a rank sends is rounded to float16, and every partial
sum is accumulated in float32 before it is rounded again for the next hop. The finished sum is
rounded to float16 once more and circulated, so all ranks return the same bits. float16 inputs
take this path even without compression (float16 is already their wire format).

Error bound. Let ``u = 2**-11`` (float16's unit roundoff) and ``S = sum_i |x_i|`` over the
``N`` ranks' values of one element. A ring rounds a partial sum at most ``N`` times (``N - 1``
hops plus the final rounding; the hierarchical algorithm at most ``N + 1`` times), and every
partial sum is bounded by ``S`` up to rounding, so

    |result - exact_sum| <= (N + 1) * u * S * (1 + u)**(N + 1)

plus float32's own rounding, which is ``2**-13`` times smaller. Values below float16's normal
range (6.1e-5) lose absolute precision instead: each rounding adds at most ``2**-25``. A partial
sum beyond float16's range (65504) becomes ``inf`` on the wire, so the result is ``inf`` (or
``nan`` where infinities of both signs meet) identically on every rank.
"""
import functools

import numpy as np

COMPRESSIONS = (None, "fp16")
UNIT_ROUNDOFF = 2.0 ** -11
SUBNORMAL_STEP = 2.0 ** -25


def check_compression(compression, dtype):
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is not known; allowed: None, 'fp16'")
    if compression == "fp16" and np.dtype(dtype).kind != "f":
        raise TypeError(f"compression='fp16' applies to floating-point arrays, not {np.dtype(dtype)}")
    return compression


@functools.lru_cache(maxsize=64)
def accumulate_dtypes(dtype, compression):
    """(accumulator dtype, wire dtype) for reducing ``dtype`` with ``compression``."""
    dtype = np.dtype(dtype)
    if compression == "fp16" or dtype == np.float16:
        return np.dtype(np.float32), np.dtype(np.float16)
    return dtype, dtype


def error_bound(abs_sum, nranks):
    """The documented bound on ``|result - exact|`` for an fp16-compressed sum, elementwise."""
    rounds = nranks + 1
    return rounds * UNIT_ROUNDOFF * np.asarray(abs_sum) * (1 + UNIT_ROUNDOFF) ** rounds \
        + rounds * SUBNORMAL_STEP


def to_wire(dst, src):
    """Round ``src`` into the narrower ``dst``; values beyond float16's range become inf, as
    documented, without NumPy's overflow warning."""
    from .ops import array_module
    with np.errstate(over="ignore"):
        array_module(dst).copyto(dst, src, casting="unsafe")
