"""alignax.losses.sft against token-by-token loops and a hand-worked example, jitted and not."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import ops
from alignax.losses.sft import sft_loss
from tests.support import references

TOL = dict(rtol=1e-6, atol=1e-6)


def token_batch(seed=0, b=4, t=6):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.05, 4.0, size=(b, t)).astype(np.float32)
    mask = np.zeros((b, t), np.float32)
    mask[0, 2:] = 1  # prompt of 2 tokens
    mask[1, 1:4] = 1  # prompt of 1, then padding
    mask[2, 5] = 1
    # row 3: no response token at all
    return logps, mask


def ref_sft(logps, mask, mode):
    """NLL ``-log pi(y_t)`` token by token, aggregated by ``mode``; metrics over all tokens."""
    nll = [-v for v in references.masked_values(logps, mask)]
    loss = references.aggregate(-np.asarray(logps, np.float64), mask, mode)
    return loss, {"nll": references.mean(nll), "ppl": math.exp(references.mean(nll)), "num_tokens": float(len(nll))}


class SFTVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((mode, mode) for mode in ops.AGGREGATION_MODES)
    def test_sft_matches_loop(self, mode):
        logps, mask = token_batch()
        loss, metrics = self.variant(functools.partial(sft_loss, aggregation=mode))(logps, mask)
        want, want_metrics = ref_sft(logps, mask, mode)
        chex.assert_shape(loss, ())
        chex.assert_type(loss, jnp.float32)
        np.testing.assert_allclose(float(loss), want, **TOL)
        for k, v in want_metrics.items():
            chex.assert_shape(metrics[k], ())
            chex.assert_type(metrics[k], jnp.float32)
            np.testing.assert_allclose(float(metrics[k]), v, **TOL, err_msg=k)

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked_three_tokens(self):
        """Response tokens with probabilities 0.5, 0.4, 0.2 after a one-token prompt.

        log 0.5 + log 0.4 + log 0.2 = log 0.04 = -3.2188758; token-mean NLL 1.0729586.
        """
        probs = np.array([0.9, 0.5, 0.4, 0.2])  # position 0 is the prompt token (masked out)
        # two-symbol vocabulary with logits [log p, log(1 - p)], target symbol 0
        logits = np.stack([np.log(probs), np.log1p(-probs)], axis=-1)[None].astype(np.float32)
        targets = np.zeros((1, 4), np.int32)
        mask = np.array([[0, 1, 1, 1]], np.float32)
        logps = ops.token_logprobs(jnp.asarray(logits), jnp.asarray(targets))
        total, _ = self.variant(functools.partial(sft_loss, aggregation="token-sum"))(logps, mask)
        np.testing.assert_allclose(-float(total), -3.2188758, atol=1e-6)
        mean, metrics = self.variant(sft_loss)(logps, mask)
        np.testing.assert_allclose(float(mean), 1.0729586, atol=1e-6)
        np.testing.assert_allclose(float(metrics["ppl"]), 0.04 ** (-1 / 3), rtol=1e-6)
        assert float(metrics["num_tokens"]) == 3.0


def test_masked_tokens_get_zero_gradient():
    logps, mask = token_batch(seed=1)
    poisoned = np.where(mask > 0, logps, -np.inf).astype(np.float32)  # prompt/pad log-probs can be anything
    for mode in ops.AGGREGATION_MODES:
        (loss, _), g = jax.value_and_grad(lambda x: sft_loss(x, mask, aggregation=mode), has_aux=True)(
            jnp.asarray(poisoned))
        g = np.asarray(g)
        assert np.isfinite(float(loss)), mode
        assert np.all(g[mask == 0] == 0.0), mode
        assert np.all(g[mask > 0] < 0.0), mode  # raising a response log-prob lowers the loss


def test_token_mean_gradient_by_hand():
    # d/d logp_it of -sum m logp / sum m is -1/N on response tokens; N = 4 here
    mask = np.array([[0, 1, 1], [1, 1, 0]], np.float32)
    g = jax.grad(lambda x: sft_loss(x, mask)[0])(jnp.full((2, 3), -1.0))
    np.testing.assert_allclose(np.asarray(g), -0.25 * mask, **TOL)


def test_all_masked_batch_is_finite_zero():
    logps = jnp.full((2, 3), -jnp.inf)
    mask = jnp.zeros((2, 3))
    for mode in ops.AGGREGATION_MODES:
        (loss, metrics), g = jax.value_and_grad(lambda x: sft_loss(x, mask, aggregation=mode), has_aux=True)(logps)
        assert float(loss) == 0.0, mode
        assert np.all(np.asarray(g) == 0.0), mode
        assert float(metrics["nll"]) == 0.0 and float(metrics["ppl"]) == 1.0 and float(metrics["num_tokens"]) == 0.0


def test_shards_sum_to_full_batch_with_global_normalisers():
    logps, mask = token_batch(seed=2)
    norms = ops.aggregation_normalisers(jnp.asarray(mask))
    for mode in ops.AGGREGATION_MODES:
        full, _ = sft_loss(logps, mask, aggregation=mode)
        parts = [sft_loss(logps[s], mask[s], aggregation=mode, **norms)[0] for s in (slice(0, 1), slice(1, 4))]
        np.testing.assert_allclose(float(parts[0] + parts[1]), float(full), **TOL, err_msg=mode)


def test_bad_inputs_name_the_argument():
    logps, mask = token_batch()
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; valid: token-mean, token-sum"):
        sft_loss(logps, mask, aggregation="mean")
    with pytest.raises(ValueError, match=r"shape mismatch: logps=\(4, 6\), mask=\(4, 5\)"):
        sft_loss(logps, mask[:, :5])
    with pytest.raises(ValueError, match="logps must have rank 2"):
        sft_loss(logps[0], mask[0])
