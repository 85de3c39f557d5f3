"""A model's forward pass as one compiled program, for tests that compare models' outputs.

Called eagerly, a Flax module runs each jax operation as a program of its own, and each new
operation and shape is compiled by XLA on first use (about 30 ms on CPU, lowering
included): a forward pass of the tiny test models is 50 to 150 such compiles, most of a
numeric test's time. ``jitted(model)`` traces the whole call into one program instead
(``alignax.models.create_model`` builds a model in one program the same way).
"""

from __future__ import annotations

import functools

import jax
from flax import nnx


def jitted(model: nnx.Module):
    """``model.__call__`` as one ``jax.jit`` program over the model's current state: array
    arguments (positional or keyword) are traced, so one compile serves every call of the
    same shapes; Python scalars given by keyword (``return_logits=False``) are static. Python
    side effects of the call (a monkeypatched counter) happen once per trace, not per call."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="static")
    def call(state, args, arrays, static):
        return nnx.merge(graphdef, state)(*args, **arrays, **dict(static))

    def run(*args, **kwargs):
        static = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))))
        arrays = {k: v for k, v in kwargs.items() if k not in dict(static)}
        return call(state, args, arrays, static)

    return run
