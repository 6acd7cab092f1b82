"""Sampling parameters checked at the precision the sampling kernels use (float32).

Why it exists: a request's `temperature` or `top_p` arrives as a JSON number (a Python float, i.e.
float64) but the sampling step holds it in a float32 tensor next to the other rows of its batch. A
value that passes a float64 range check can still be zero, subnormal or infinite in float32
(`temperature=1e-40`, `top_p=1e-300`, `temperature=1e39`), and the step then divides by zero or
keeps no token: the whole batch's sampling throws and every request in it is aborted. Every server
that accepts sampling parameters from outside (the reference engine, the TITO session server)
refuses such values with a 400 naming the field, before a kernel sees them.

Temperatures in (0, GREEDY_BELOW) are sampled greedily, as SGLang does (its SamplingParams turn
`0 <= temperature < 1e-6` into top_k=1): dividing logits by them overflows float32 even when the
value itself is a normal float32.

Who calls it: lockstep.engine.core (request validation), lockstep.engine.runner (the greedy rule),
lockstep.rollout.session.server (turn options).
"""

from __future__ import annotations

import math

FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest positive normal float32 (torch.finfo(torch.float32).tiny)."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32."""
GREEDY_BELOW = 1e-6
"""Temperatures below this (0 included) sample greedily, as SGLang's SamplingParams._SAMPLING_EPS."""


def float32_problem(field: str, value: float, *, zero_ok: bool) -> str | None:
    """Why `value` cannot be used as a float32 sampling parameter, naming `field`; None when it can.

    Refused: NaN and infinities, magnitudes above float32's largest finite value (they become inf),
    and non-zero magnitudes below its smallest normal value (they become zero or subnormal, and the
    kernels divide by them). zero_ok: 0 itself is a meaningful value (temperature 0 is greedy)."""
    if not math.isfinite(value):
        return f"{field} is {value}; send a finite number"
    if abs(value) > FLOAT32_MAX:
        return (
            f"{field} {value!r} overflows float32 (largest {FLOAT32_MAX:.4g}), the precision it is sampled at"
        )
    if value == 0.0:
        return None if zero_ok else f"{field} is 0; it must be positive"
    if abs(value) < FLOAT32_TINY:
        return (
            f"{field} {value!r} underflows float32 (smallest normal {FLOAT32_TINY:.4g}), the precision "
            f"it is sampled at; send 0{' for greedy' if zero_ok else ''} or a value >= {FLOAT32_TINY:.4g}"
        )
    return None


def sampling_problem(temperature: float, top_p: float, prefix: str = "sampling_params.") -> str | None:
    """The first of `temperature` and `top_p` that float32 cannot carry (see float32_problem), or None."""
    return float32_problem(f"{prefix}temperature", temperature, zero_ok=True) or float32_problem(
        f"{prefix}top_p", top_p, zero_ok=False
    )
