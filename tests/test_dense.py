"""``alignax.models.dense``: its hand-written backward equals autodiff of the same einsum."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from alignax.models.dense import dense

# (x shape, w shape, in_axes, transposed, einsum of the same product)
CASES = {
    "projection": ((2, 5, 6), (6, 3, 4), 1, False, "btd,dnh->btnh"),
    "out_proj": ((2, 5, 3, 4), (3, 4, 6), 2, False, "btnh,nhd->btd"),
    "tied_head": ((2, 5, 6), (7, 6), 1, True, "btd,vd->btv"),
    "unbatched": ((6,), (6, 7), 1, False, "d,dv->v"),
}


def _inputs(x_shape, w_shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=x_shape), dtype)
    w = jnp.asarray(rng.normal(size=w_shape), dtype)
    return x, w


@pytest.mark.parametrize("case", CASES)
def test_value_and_gradients_equal_einsum(case):
    x_shape, w_shape, in_axes, transposed, spec = CASES[case]
    x, w = _inputs(x_shape, w_shape, jnp.float32)
    y_ref = jnp.einsum(spec, x, w)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=y_ref.shape), jnp.float32)

    def ours(x, w):
        return jnp.sum(dense(x, w, in_axes=in_axes, transposed=transposed) * cot)

    def ref(x, w):
        return jnp.sum(jnp.einsum(spec, x, w) * cot)

    np.testing.assert_allclose(dense(x, w, in_axes=in_axes, transposed=transposed), y_ref, rtol=1e-6, atol=1e-6)
    gx, gw = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, w)
    rx, rw = jax.grad(ref, argnums=(0, 1))(x, w)
    assert gx.shape == x.shape and gw.shape == w.shape
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)
    # and against the products written out in NumPy (float64)
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, cot))
    np.testing.assert_allclose(gx, np.einsum(_grad_x_spec(spec), c64, w64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, np.einsum(_grad_w_spec(spec), x64, c64), rtol=1e-5, atol=1e-5)


def _grad_x_spec(spec):
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    return f"{out},{ws}->{xs}"


def _grad_w_spec(spec):
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    return f"{xs},{out}->{ws}"


def test_bfloat16_operands_float32_accumulation():
    x, w = _inputs((3, 4, 8), (9, 8), jnp.bfloat16)
    y = dense(x, w, transposed=True, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32
    ref = jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    gx, gw = jax.grad(lambda x, w: jnp.sum(dense(x, w, transposed=True, out_dtype=jnp.float32) ** 2), (0, 1))(x, w)
    rx, rw = jax.grad(
        lambda x, w: jnp.sum(jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32) ** 2), (0, 1)
    )(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(rx, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(rw, np.float32), rtol=2e-2, atol=2e-2)


def test_mismatched_axes_are_an_error():
    x, w = _inputs((2, 6), (5, 3), jnp.float32)
    with pytest.raises(ValueError, match="contracted axes"):
        dense(x, w)
    with pytest.raises(ValueError, match="in_axes=3"):
        dense(x, w, in_axes=3)
