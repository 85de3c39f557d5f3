"""alignax.losses.distill against NumPy references written from the formulas (float64,
position by position), values and gradients, jitted and not; masks with empty rows."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import ops
from alignax.losses import distill
from tests.support import references

TOL = dict(rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------- references
def np_softmax(logits, temperature):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def np_kl(p, q):
    return float(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0))


def np_divergence(student, teacher, kind, *, beta=0.5, temperature=1.0):
    """One position's divergence from its definition: ``P`` teacher, ``Q`` student."""
    p, q = np_softmax(teacher, temperature), np_softmax(student, temperature)
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return np_kl(p, q)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return np_kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * np_kl(p, m) + (1 - beta) * np_kl(q, m)


def np_sparse(student, topk_logps, topk_ids, temperature):
    """Teacher's top-k renormalised at the temperature against the student's full softmax."""
    p = np_softmax(topk_logps, temperature)
    q = np_softmax(student, temperature)[np.asarray(topk_ids)]
    return float(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))


def np_loss(per_position, student, mask, mode):
    b, t = mask.shape
    per_token = np.array([[per_position(i, j) if mask[i, j] else 0.0 for j in range(t)] for i in range(b)])
    return references.aggregate(per_token, mask, mode), per_token


def logits_batch(seed=0, b=4, t=5, v=7):
    rng = np.random.default_rng(seed)
    student = rng.normal(0, 1.5, size=(b, t, v)).astype(np.float32)
    teacher = rng.normal(0, 2.0, size=(b, t, v)).astype(np.float32)
    mask = np.zeros((b, t), np.float32)
    mask[0, 1:] = 1
    mask[1, 1:t - 1] = 1
    if b > 2:
        mask[2, t - 1] = 1
    # the last row is empty (no counted token)
    mask[b - 1] = 0
    return student, teacher, mask


CASES = [("forward_kl", "forward_kl", 0.5), ("reverse_kl", "reverse_kl", 0.5), ("jsd_half", "jsd", 0.5),
         ("jsd_0.1", "jsd", 0.1), ("jsd_0", "jsd", 0.0), ("jsd_1", "jsd", 1.0)]


class DistillLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*[(f"{name}_{mode}", kind, beta, mode)
                                      for name, kind, beta in CASES for mode in ops.AGGREGATION_MODES])
    def test_value_equals_reference(self, kind, beta, mode):
        student, teacher, mask = logits_batch()
        temperature = 1.7
        fn = self.variant(lambda s, t, m: distill.distill_loss(s, t, m, divergence=kind, beta=beta,
                                                               temperature=temperature, aggregation=mode))
        loss, metrics = fn(student, teacher, mask)
        want, per_token = np_loss(lambda i, j: np_divergence(student[i, j], teacher[i, j], kind, beta=beta,
                                                             temperature=temperature), student, mask, mode)
        np.testing.assert_allclose(loss, want, **TOL)
        np.testing.assert_allclose(metrics["divergence"], references.mean(references.masked_values(per_token, mask)),
                                   **TOL)
        agree = [float(np.argmax(student[i, j]) == np.argmax(teacher[i, j])) for i, j in zip(*np.nonzero(mask))]
        np.testing.assert_allclose(metrics["teacher_agreement"], references.mean(agree), **TOL)
        assert float(metrics["num_tokens"]) == mask.sum()

    @parameterized.parameters("forward_kl", "reverse_kl", "jsd")
    def test_gradient_equals_finite_difference(self, kind):
        student, teacher, mask = logits_batch(seed=1, b=3, t=3, v=4)
        mode = "seq-mean-token-mean"

        def ref(s):
            return np_loss(lambda i, j: np_divergence(s[i, j], teacher[i, j], kind, beta=0.3, temperature=0.8),
                           s, mask, mode)[0]

        grad = jax.grad(lambda s: distill.distill_loss(s, teacher, mask, divergence=kind, beta=0.3, temperature=0.8,
                                                       aggregation=mode)[0])(jnp.asarray(student))
        np.testing.assert_allclose(grad, references.finite_difference(ref, student), rtol=1e-4, atol=1e-6)
        # the teacher is a constant
        teacher_grad = jax.grad(lambda t: distill.distill_loss(student, t, mask, divergence=kind)[0])(
            jnp.asarray(teacher))
        np.testing.assert_array_equal(teacher_grad, 0.0)

    def test_jsd_limits_are_forward_and_reverse_kl(self):
        student, teacher, _ = logits_batch(seed=2)
        student, teacher = student / 3, teacher / 3  # bounded ratios p/q: the first-order limit shows at eps = 1e-3
        fwd = distill.forward_kl(student, teacher)
        rev = distill.reverse_kl(student, teacher)
        np.testing.assert_allclose(distill.generalized_jsd(student, teacher, beta=0.0), fwd, rtol=1e-6)
        np.testing.assert_allclose(distill.generalized_jsd(student, teacher, beta=1.0), rev, rtol=1e-6)
        # the endpoints continue the interior: JSD(beta) / beta -> KL(P||Q), JSD(beta) / (1 - beta) -> KL(Q||P)
        eps = 1e-3
        np.testing.assert_allclose(distill.generalized_jsd(student, teacher, beta=eps) / eps, fwd, rtol=1e-2)
        np.testing.assert_allclose(distill.generalized_jsd(student, teacher, beta=1 - eps) / eps, rev, rtol=1e-2)
        assert not np.allclose(fwd, rev, rtol=1e-2)  # the two limits differ on this batch

    def test_masked_positions_never_reach_loss_or_gradient(self):
        student, teacher, mask = logits_batch(seed=3)
        poisoned_s, poisoned_t = student.copy(), teacher.copy()
        poisoned_s[mask == 0] = np.nan
        poisoned_t[mask == 0] = np.inf
        for kind in distill.DIVERGENCES:
            loss = lambda s: distill.distill_loss(s, poisoned_t, mask, divergence=kind)[0]  # noqa: E731
            clean = distill.distill_loss(student, teacher, mask, divergence=kind)[0]
            np.testing.assert_allclose(loss(poisoned_s), clean, rtol=1e-6)
            grad = jax.grad(loss)(jnp.asarray(poisoned_s))
            assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[mask == 0] == 0.0)

    def test_a_token_the_teacher_rules_out_adds_nothing(self):
        """Teacher logits of -inf (a vocabulary filter) are zero-probability tokens: ``0 log 0 = 0``,
        so the forward KL, the JSD and their gradients stay finite and equal the definition's sum
        over the teacher's support."""
        student, teacher, mask = logits_batch(seed=11, b=2, t=3, v=5)
        teacher[..., :2] = -np.inf
        for kind in ("forward_kl", "jsd"):
            loss, metrics = distill.distill_loss(student, teacher, mask, divergence=kind)
            want, _ = np_loss(lambda i, j: np_divergence(student[i, j], teacher[i, j], kind), student, mask,
                              "token-mean")
            np.testing.assert_allclose(loss, want, err_msg=kind, **TOL)
            grad = jax.grad(lambda s: distill.distill_loss(s, teacher, mask, divergence=kind)[0])(jnp.asarray(student))
            assert np.all(np.isfinite(grad)), kind

    def test_empty_batch_is_zero(self):
        student, teacher, mask = logits_batch()
        for mode in ops.AGGREGATION_MODES:
            loss, metrics = distill.distill_loss(student, teacher, np.zeros_like(mask), aggregation=mode)
            assert float(loss) == 0.0 and float(metrics["divergence"]) == 0.0

    def test_global_normalisers_make_shards_sum_to_full_batch(self):
        student, teacher, mask = logits_batch(seed=4)
        for mode in ops.AGGREGATION_MODES:
            full, _ = distill.distill_loss(student, teacher, mask, aggregation=mode)
            norm = ops.aggregation_normalisers(mask)
            halves = sum(distill.distill_loss(student[s], teacher[s], mask[s], aggregation=mode, **norm)[0]
                         for s in (slice(0, 2), slice(2, 4)))
            np.testing.assert_allclose(halves, full, rtol=1e-5)

    def test_the_default_divergence_is_the_configs_forward_kl(self):
        """One default: a call without ``divergence`` is the forward KL, as ``distill.divergence``
        is by default (the function said jsd while the config said forward_kl)."""
        from alignax.trainers.config import DistillSection

        student, teacher, mask = logits_batch(seed=5)
        loss, _ = distill.distill_loss(student, teacher, mask)
        want, _ = np_loss(lambda i, j: np_divergence(student[i, j], teacher[i, j], "forward_kl"), student, mask,
                          "token-mean")
        np.testing.assert_allclose(loss, want, **TOL)
        assert DistillSection().divergence == "forward_kl"

    def test_the_per_position_divergences_default_to_beta_half_and_temperature_one(self):
        """Called without ``beta`` / ``temperature``, each public divergence is its definition at
        ``beta = 0.5`` (GKD's symmetric JSD) and ``temperature = 1``; from float16 logits it is
        still computed in float32 (a float16 softmax is off by ~1e-3)."""
        student, teacher, _ = logits_batch(seed=8, b=2, t=2, v=5)
        student, teacher = student.astype(np.float16), teacher.astype(np.float16)  # exact in the float64 reference
        logps, ids = distill.teacher_topk(teacher, 3)
        got = {"forward_kl": distill.forward_kl(student, teacher), "reverse_kl": distill.reverse_kl(student, teacher),
               "jsd": distill.generalized_jsd(student, teacher),
               "sparse": distill.sparse_forward_kl(student, logps, ids)}
        for name, value in got.items():
            want = [[np_divergence(student[i, j], teacher[i, j], name) if name != "sparse" else
                     np_sparse(student[i, j], np.asarray(logps[i, j], np.float64), ids[i, j], 1.0)
                     for j in range(2)] for i in range(2)]
            assert value.dtype == jnp.float32, name
            np.testing.assert_allclose(value, want, err_msg=name, **TOL)

    def test_a_boolean_mask_counts_tokens_in_float32(self):
        """A boolean mask is the float one: same loss and metrics, every metric float32 (the
        token count included: summing the booleans themselves would give an int32 count)."""
        student, teacher, mask = logits_batch(seed=10, b=2, t=3, v=4)
        logps, ids = distill.teacher_topk(teacher, 2)
        for fn, args in ((distill.distill_loss, (student, teacher)),
                         (distill.sparse_distill_loss, (student, logps, ids))):
            loss, metrics = fn(*args, mask > 0)
            want_loss, want = fn(*args, mask)
            np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
            for name, value in metrics.items():
                assert value.dtype == jnp.float32, (fn.__name__, name, value.dtype)
                np.testing.assert_allclose(value, want[name], rtol=1e-6, err_msg=name)

    def test_refusals_name_the_argument(self):
        student, teacher, mask = logits_batch()
        with pytest.raises(ValueError, match="divergence"):
            distill.distill_loss(student, teacher, mask, divergence="kl")
        with pytest.raises(ValueError, match="beta"):
            distill.distill_loss(student, teacher, mask, beta=1.5)
        with pytest.raises(ValueError, match="temperature"):
            distill.distill_loss(student, teacher, mask, temperature=0.0)
        with pytest.raises(ValueError, match=r"student_logits has shape .*leading dims must be mask's shape"):
            distill.distill_loss(student, teacher, mask[:, 1:])


class SparseDistillLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*ops.AGGREGATION_MODES)
    def test_value_equals_reference(self, mode):
        student, teacher, mask = logits_batch(seed=5)
        k, temperature = 3, 1.3
        logps, ids = distill.teacher_topk(teacher, k)
        loss, metrics = self.variant(lambda *a: distill.sparse_distill_loss(*a, temperature=temperature,
                                                                            aggregation=mode))(student, logps, ids,
                                                                                               mask)
        # the reference picks the top k itself, from the teacher's log-softmax
        def position(i, j):
            log_p = np.log(np_softmax(teacher[i, j], 1.0))
            top = np.argsort(-log_p)[:k]
            return np_sparse(student[i, j], log_p[top], top, temperature)

        want, per_token = np_loss(position, student, mask, mode)
        np.testing.assert_allclose(loss, want, **TOL)
        np.testing.assert_allclose(metrics["divergence"], references.mean(references.masked_values(per_token, mask)),
                                   **TOL)
        # agreement with the teacher's argmax, the first stored id (not any other of the k)
        agree = [float(np.argmax(student[i, j]) == np.argmax(teacher[i, j])) for i, j in zip(*np.nonzero(mask))]
        assert 0 < np.mean(agree) < 1
        np.testing.assert_allclose(metrics["teacher_agreement"], references.mean(agree), **TOL)
        assert float(metrics["num_tokens"]) == mask.sum()

    def test_teacher_topk_stores_float32_log_probs_over_the_whole_vocabulary(self):
        """The stored table: the ``k`` largest of the teacher's log-softmax over all ``V`` tokens at
        temperature 1 (a shift of every entry would cancel in the loss's renormalisation, so the
        table is checked itself), as float32 whatever the logits' dtype, ids int32."""
        _, teacher, _ = logits_batch(seed=9, b=2, t=3, v=6)
        half = teacher.astype(np.float16)  # exact in float32 and float64: the reference reads the same numbers
        logps, ids = distill.teacher_topk(half, 4)
        assert logps.dtype == jnp.float32 and ids.dtype == jnp.int32
        log_p = np.log(np.apply_along_axis(np_softmax, -1, half.astype(np.float64), 1.0))
        top = np.argsort(-log_p, axis=-1)[..., :4]
        np.testing.assert_array_equal(ids, top)
        np.testing.assert_allclose(logps, np.take_along_axis(log_p, top, axis=-1), rtol=1e-6, atol=1e-6)

    def test_full_vocabulary_equals_dense_forward_kl(self):
        student, teacher, mask = logits_batch(seed=6)
        logps, ids = distill.teacher_topk(teacher, teacher.shape[-1])
        sparse, _ = distill.sparse_distill_loss(student, logps, ids, mask, temperature=0.7)
        dense, _ = distill.distill_loss(student, teacher, mask, divergence="forward_kl", temperature=0.7)
        np.testing.assert_allclose(sparse, dense, rtol=1e-5)

    def test_gradient_equals_finite_difference(self):
        student, teacher, mask = logits_batch(seed=7, b=2, t=3, v=5)
        logps, ids = distill.teacher_topk(teacher, 2)
        logps, ids = np.asarray(logps, np.float64), np.asarray(ids)

        def ref(s):
            return np_loss(lambda i, j: np_sparse(s[i, j], logps[i, j], ids[i, j], 1.0), s, mask, "token-mean")[0]

        grad = jax.grad(lambda s: distill.sparse_distill_loss(s, logps, ids, mask)[0])(jnp.asarray(student))
        np.testing.assert_allclose(grad, references.finite_difference(ref, student), rtol=1e-4, atol=1e-6)
