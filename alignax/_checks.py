"""Argument checks shared by the functional core: ranks, shapes and names of choices.

They run at trace time on static shapes, so they cost nothing inside ``jax.jit``, and
their errors name the argument that is wrong and what would be right. Rank and shape
checks are chex's (``chex.assert_rank``, ``chex.assert_equal_shape``), re-raised as a
``ValueError`` that names the argument, so callers catch one exception type.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import chex
import numpy as np


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


class _Shaped:
    """A shape-only stand-in, so chex checks Python scalars and lists like arrays."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


def check_rank(**named: tuple[object, int | tuple[int, ...]]) -> None:
    """``check_rank(logits=(logits, 3), mask=(mask, (1, 2)))``: raise naming the argument."""
    for name, (value, ranks) in named.items():
        allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        try:
            chex.assert_rank(_Shaped(_shape(value)), set(allowed))
        except AssertionError:
            want = " or ".join(str(r) for r in allowed)
            rank = len(_shape(value))
            raise ValueError(f"{name} must have rank {want}; got shape {_shape(value)} (rank {rank})") from None


def check_same_shape(**named: object) -> None:
    """All named arrays have one shape; the error lists every argument with its shape."""
    shapes = {name: _shape(value) for name, value in named.items()}
    try:
        chex.assert_equal_shape([_Shaped(shape) for shape in shapes.values()])
    except AssertionError:
        listed = ", ".join(f"{n}={s}" for n, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed}") from None


def check_leading_shape(reference: str, ref_value: object, **named: object) -> None:
    """Each named array's leading dims equal ``ref_value``'s full shape."""
    ref = _shape(ref_value)
    for name, value in named.items():
        shape = _shape(value)
        if shape[: len(ref)] != ref:
            raise ValueError(f"{name} has shape {shape}; its leading dims must be {reference}'s shape {ref}")


def check_choice(name: str, value: str, choices: Iterable[str]) -> None:
    """``value`` is one of ``choices``; otherwise the error lists the valid ones."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(choices)}")


def is_concrete_number(value) -> bool:
    """A plain Python/NumPy number (not a bool, not a traced or device array)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_interval(name: str, value, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> None:
    """``value`` lies in the interval; checked only for plain numbers, so hyper-parameters
    may also be passed as traced arrays (e.g. a KL coefficient carried in the state)."""
    if not is_concrete_number(value):
        return
    v = float(value)
    below = v <= low if low_open else v < low
    above = v >= high if high_open else v > high
    if below or above or math.isnan(v):
        lb = "(" if low_open else "["
        rb = ")" if high_open else "]"
        raise ValueError(f"{name} must lie in {lb}{low}, {high}{rb}; got {value}")
