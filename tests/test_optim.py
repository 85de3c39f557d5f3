"""build_optimizer (alignax/trainers/engine/optim.py): the learning-rate schedule at chosen
steps against hand-computed values, weight decay on matrices only, and global-norm
clipping (on and off), each read off the updates the optimiser actually applies."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from alignax.trainers.engine.optim import OptimConfig, build_optimizer


def schedule_values(config, total_steps, steps):
    _, schedule = build_optimizer(config, total_steps)
    return [float(schedule(s)) for s in steps]


def applied_lrs(config, total_steps, n):
    """The learning rate the optimiser applied at steps 0..n-1: plain SGD on a gradient of 1
    moves the parameter by exactly -lr(step)."""
    optimizer, _ = build_optimizer(config, total_steps)
    params = {"x": jnp.zeros((1,), jnp.float32)}
    state = optimizer.init(params)
    grads = {"x": jnp.ones((1,), jnp.float32)}
    out = []
    for _ in range(n):
        updates, state = optimizer.update(grads, state, params)
        out.append(-float(updates["x"][0]))
    return out


# peak 1e-3, 10 warmup steps, 100 decay steps (total 110), floor 1e-4 (min_lr_ratio 0.1)
PEAK, WARMUP, TOTAL, RATIO = 1e-3, 10, 110, 0.1


def test_warmup_then_cosine_to_the_floor():
    config = OptimConfig(learning_rate=PEAK, schedule="cosine", warmup_steps=WARMUP, min_lr_ratio=RATIO)
    got = schedule_values(config, TOTAL, [0, 5, 10, 35, 60, 85, 110, 500])
    # cosine over the 100 decay steps: 1e-4 + 9e-4 * (1 + cos(pi * t / 100)) / 2
    expected = [0.0, 5e-4, 1e-3,
                1e-4 + 9e-4 * (1 + math.cos(math.pi * 0.25)) / 2,  # 8.682e-4
                5.5e-4,
                1e-4 + 9e-4 * (1 + math.cos(math.pi * 0.75)) / 2,  # 2.318e-4
                1e-4, 1e-4]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(expected[3], 8.68198e-4, rtol=1e-5)  # the hand value


def test_warmup_then_linear_to_the_floor():
    config = OptimConfig(learning_rate=PEAK, schedule="linear", warmup_steps=WARMUP, min_lr_ratio=RATIO)
    got = schedule_values(config, TOTAL, [0, 2, 10, 35, 60, 110, 300])
    expected = [0.0, 2e-4, 1e-3, 7.75e-4, 5.5e-4, 1e-4, 1e-4]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)


def test_constant_schedule_with_and_without_warmup():
    warm = OptimConfig(learning_rate=PEAK, schedule="constant", warmup_steps=4, min_lr_ratio=RATIO)
    np.testing.assert_allclose(schedule_values(warm, TOTAL, [0, 1, 3, 4, 50, 110]),
                               [0.0, 2.5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6, atol=1e-12)
    flat = OptimConfig(learning_rate=PEAK, schedule="constant", min_lr_ratio=RATIO)
    assert schedule_values(flat, TOTAL, [0, 55, 110]) == pytest.approx([1e-3] * 3, rel=1e-6)


def test_cosine_without_warmup_starts_at_the_peak_and_decays_to_zero_by_default():
    config = OptimConfig(learning_rate=2e-3, schedule="cosine")
    np.testing.assert_allclose(schedule_values(config, 40, [0, 20, 40]), [2e-3, 1e-3, 0.0], rtol=1e-5, atol=1e-9)


def test_the_optimizer_applies_its_schedule():
    config = OptimConfig(name="sgd", learning_rate=PEAK, schedule="linear", warmup_steps=4, min_lr_ratio=RATIO,
                         max_grad_norm=None)
    got = applied_lrs(config, 14, 16)
    # warmup 0, .25, .5, .75 x peak; then linear over 10 steps from 1e-3 to 1e-4; then 1e-4
    expected = [0.0, 2.5e-4, 5e-4, 7.5e-4] + [1e-3 - 9e-5 * k for k in range(10)] + [1e-4, 1e-4]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)


def test_weight_decay_applies_to_matrices_only():
    lr, wd = 1e-2, 0.1
    config = OptimConfig(name="adamw", learning_rate=lr, schedule="constant", weight_decay=wd)
    optimizer, _ = build_optimizer(config, 10)
    params = {"kernel": jnp.full((3, 4), 2.0), "stack": jnp.full((2, 2, 2), -3.0), "bias": jnp.full((4,), 2.0),
              "scale": jnp.asarray(5.0)}
    grads = {k: jnp.zeros_like(v) for k, v in params.items()}  # Adam's own step is exactly 0
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    # decoupled decay on rank >= 2: p - lr * wd * p
    np.testing.assert_allclose(new["kernel"], 2.0 - lr * wd * 2.0, rtol=1e-6)
    np.testing.assert_allclose(new["stack"], -3.0 + lr * wd * 3.0, rtol=1e-6)
    np.testing.assert_array_equal(new["bias"], params["bias"])  # norms and biases never decay
    np.testing.assert_array_equal(new["scale"], params["scale"])
    # no decay without weight_decay
    plain, _ = build_optimizer(OptimConfig(name="adamw", learning_rate=lr, schedule="constant"), 10)
    updates, _ = plain.update(grads, plain.init(params), params)
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["kernel"], params["kernel"])


def sgd_update(max_grad_norm, grads):
    config = OptimConfig(name="sgd", learning_rate=1.0, schedule="constant", max_grad_norm=max_grad_norm)
    optimizer, _ = build_optimizer(config, 10)
    params = {k: jnp.zeros_like(v) for k, v in grads.items()}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return {k: np.asarray(v) for k, v in updates.items()}


def global_norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(v)) for v in tree.values())))


def test_clipping_bounds_the_global_gradient_norm():
    grads = {"a": jnp.asarray([3.0, 0.0]), "b": jnp.asarray([[0.0, 4.0]])}  # global norm 5
    clipped = sgd_update(1.0, grads)
    unclipped = sgd_update(None, grads)
    # sgd at lr 1 applies -g: without clipping the update has norm 5, with it norm 1 and
    # the same direction (every leaf scaled by 1 / 5, not clipped leaf by leaf)
    assert global_norm(unclipped) == pytest.approx(5.0, rel=1e-6)
    assert global_norm(clipped) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(clipped["a"], [-0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped["b"], [[0.0, -0.8]], rtol=1e-6)
    np.testing.assert_allclose(unclipped["a"], [-3.0, 0.0], rtol=1e-6)
    # a larger bound scales to it
    assert global_norm(sgd_update(2.5, grads)) == pytest.approx(2.5, rel=1e-6)


def test_gradients_below_the_bound_are_untouched():
    grads = {"a": jnp.asarray([0.3, 0.0]), "b": jnp.asarray([[0.0, 0.4]])}  # norm 0.5 < 1
    np.testing.assert_allclose(sgd_update(1.0, grads)["a"], [-0.3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(sgd_update(1.0, grads)["b"], [[0.0, -0.4]], rtol=1e-6)


def test_max_grad_norm_null_disables_clipping():
    grads = {"a": jnp.asarray([300.0, 0.0]), "b": jnp.asarray([[0.0, 400.0]])}
    out = sgd_update(None, grads)
    assert global_norm(out) == pytest.approx(500.0, rel=1e-6)
    # and with AdamW too: the first Adam step is lr * g / |g| whatever the scale, so compare
    # the clip-free chain with the clipped one on its moments instead
    config = OptimConfig(name="adamw", learning_rate=1e-2, schedule="constant", max_grad_norm=None)
    optimizer, _ = build_optimizer(config, 10)
    params = {k: jnp.zeros_like(v) for k, v in grads.items()}
    _, state = optimizer.update(grads, optimizer.init(params), params)
    mu = [np.asarray(s.mu["a"]) for s in jax_leaves_with_mu(state)]
    np.testing.assert_allclose(mu[0], 0.1 * np.asarray(grads["a"]), rtol=1e-6)  # (1 - b1) * g, unclipped
    clipped_opt, _ = build_optimizer(OptimConfig(name="adamw", learning_rate=1e-2, schedule="constant",
                                                 max_grad_norm=1.0), 10)
    _, state = clipped_opt.update(grads, clipped_opt.init(params), params)
    mu = [np.asarray(s.mu["a"]) for s in jax_leaves_with_mu(state)]
    np.testing.assert_allclose(mu[0], 0.1 * np.asarray(grads["a"]) / 500.0, rtol=1e-6)  # clipped to norm 1


def jax_leaves_with_mu(state):
    """The Adam moment states inside an optax chain state."""
    import jax

    return [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]


def test_schedule_step_sets_the_learning_rate_position():
    """``update(..., schedule_step=n)`` applies lr(n) whatever the optimiser's own count (the
    online trainer passes each update's position in the run, so skipped or early-stopped
    updates do not shift the schedule)."""
    config = OptimConfig(name="sgd", learning_rate=PEAK, schedule="linear", warmup_steps=WARMUP, min_lr_ratio=RATIO,
                         max_grad_norm=None)
    optimizer, _ = build_optimizer(config, TOTAL)
    params = {"x": jnp.zeros((1,), jnp.float32)}
    grads = {"x": jnp.ones((1,), jnp.float32)}
    state = optimizer.init(params)
    got = []
    for position in (60, 5, 110, 0, 35):
        updates, state = optimizer.update(grads, state, params, schedule_step=jnp.asarray(position))
        got.append(-float(updates["x"][0]))
    np.testing.assert_allclose(got, [5.5e-4, 5e-4, 1e-4, 0.0, 7.75e-4], rtol=1e-5, atol=1e-9)
    # without it, the optimiser's own count: 0, 1, 2, ...
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert -float(updates["x"][0]) == 0.0
