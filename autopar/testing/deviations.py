"""How far a value lands from the reference's, for the parity harness (`testing.parity`).

A NaN deviation must fail a bound, not pass it: `x > bound` is False for NaN, and Python's
`max` keeps whichever of a NaN and a number comes first, so a NaN loss or gradient could
pass every check (a padded batch's NaN loss did, `tests/test_padded_loss.py`).
"""

from __future__ import annotations

import math


def unbounded_if_nan(err: float) -> float:
    """A NaN deviation (a NaN value on our side) as infinite: `max` would drop it."""
    return math.inf if math.isnan(err) else err


def loss_deviation(ours: float, ref: float) -> float:
    """|ours - ref| / |ref|; 0 where both are the same non-finite value (fp16: a step the
    loss scaler skips), unbounded where only one is (a NaN loss is no match)."""
    if not (math.isfinite(ours) and math.isfinite(ref)):
        return 0.0 if str(ours) == str(ref) else math.inf
    return abs(ours - ref) / abs(ref)
