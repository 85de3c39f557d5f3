"""alignax.ops against NumPy loops written from the definitions, jitted and not."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import ops
from tests.support import references


def batch(seed=0, b=4, t=7):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t)).astype(np.float32)
    mask = (rng.uniform(size=(b, t)) > 0.4).astype(np.float32)
    mask[-1] = 0.0  # one row with no response token at all
    return x, mask


def ref_logprob_entropy(logits, targets, temperature=1.0):
    """``log p = z - lse(z)`` at the target and ``H = -sum_k p_k log p_k``, ``z = logits / tau``."""
    b, t, v = logits.shape
    lp = np.zeros((b, t))
    ent = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            z = logits[i, j].astype(np.float64) / temperature
            m = max(z)
            lse = m + math.log(sum(math.exp(zk - m) for zk in z))
            lp[i, j] = z[targets[i, j]] - lse
            ent[i, j] = -sum(math.exp(zk - lse) * (zk - lse) for zk in z)
    return lp, ent


class OpsVariantsTest(chex.TestCase):
    """Each function jitted and not (chex variants), against the loops."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_reductions_match_loops(self):
        x, mask = batch()
        vals = references.masked_values(x, mask)
        mean, var = references.mean(vals), references.variance(vals, ddof=1)
        np.testing.assert_allclose(self.variant(ops.masked_sum)(x, mask), sum(vals), rtol=1e-6)
        np.testing.assert_allclose(self.variant(ops.masked_mean)(x, mask), mean, rtol=1e-6)
        np.testing.assert_allclose(self.variant(ops.masked_var)(x, mask), var, rtol=1e-6)
        white = self.variant(ops.masked_whiten)(x, mask)
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                want = (x[i, j] - mean) / math.sqrt(var + 1e-8) if mask[i, j] else 0.0
                assert abs(float(white[i, j]) - want) < 1e-5
        kept = self.variant(functools.partial(ops.masked_whiten, shift_mean=False))(x, mask)
        np.testing.assert_allclose(kept[0, mask[0] > 0], white[0, mask[0] > 0] + mean, atol=1e-6)
        row_means = self.variant(functools.partial(ops.masked_mean, axis=-1))(x, mask)
        np.testing.assert_allclose(row_means[-1], 0.0)  # empty row: 0, not NaN

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((mode, mode) for mode in ops.AGGREGATION_MODES)
    def test_aggregate_matches_loop(self, mode):
        x, mask = batch(seed=1)
        got = self.variant(functools.partial(ops.aggregate, mode=mode))(x, mask)
        # float32 sums of ~17 terms against the float64 loop: a few ulps, in an order that
        # depends on how XLA vectorises the reduction (measured up to 1.6e-6 relative)
        np.testing.assert_allclose(got, references.aggregate(x, mask, mode), rtol=5e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("direct", None), ("chunked", 3))
    def test_token_logprobs_and_entropy_match_loop(self, chunk_size):
        rng = np.random.default_rng(5)
        logits = rng.normal(size=(2, 7, 11)).astype(np.float32) * 3
        targets = rng.integers(0, 11, size=(2, 7))
        want_lp, want_ent = ref_logprob_entropy(logits, targets, temperature=0.7)
        hp = dict(temperature=0.7, chunk_size=chunk_size)
        lp = self.variant(functools.partial(ops.token_logprobs, **hp))(logits, targets)
        ent = self.variant(functools.partial(ops.entropy_from_logits, **hp))(logits)
        both = self.variant(functools.partial(ops.token_logprobs_and_entropy, **hp))(logits, targets)
        # float32 rounding of log-softmax is relative to the logits' scale, not the result's.
        atol = 1e-6 * np.abs(logits / 0.7).max()
        np.testing.assert_allclose(lp, want_lp, atol=atol)
        np.testing.assert_allclose(ent, want_ent, atol=atol)
        np.testing.assert_allclose(both[0], want_lp, atol=atol)
        np.testing.assert_allclose(both[1], want_ent, atol=atol)
        chex.assert_type([lp, ent, *both], jnp.float32)


def test_seq_mean_token_sum_norm_uses_given_length():
    x, mask = batch(seed=2)
    got = ops.aggregate(x, mask, mode="seq-mean-token-sum-norm", norm_length=100.0)
    want = references.aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=100.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("mode", ops.AGGREGATION_MODES)
def test_micro_batches_with_global_normalisers_sum_to_full_batch(mode):
    x, mask = batch(seed=3, b=6, t=5)
    full = ops.aggregate(x, mask, mode=mode)
    norms = ops.aggregation_normalisers(mask)
    parts = [ops.aggregate(x[s], mask[s], mode=mode, **norms) for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)


@pytest.mark.parametrize("mode", ops.AGGREGATION_MODES)
def test_masked_tokens_get_exactly_zero_gradient(mode):
    x, mask = batch(seed=4)
    x = x.copy()
    x[mask == 0] = 1e30  # garbage under the mask must not leak
    grad = jax.grad(lambda v: ops.aggregate(v**2, mask, mode=mode))(jnp.asarray(x))
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("mode", ops.AGGREGATION_MODES)
def test_all_masked_batch_is_finite_zero(mode):
    x = jnp.ones((3, 4))
    mask = jnp.zeros((3, 4))
    value, grad = jax.value_and_grad(lambda v: ops.aggregate(v, mask, mode=mode))(x)
    assert float(value) == 0.0
    assert np.all(np.asarray(grad) == 0.0)


def test_token_logprobs_hand_worked():
    # Tokens with probabilities 0.5, 0.4 and 0.2: log(0.5 * 0.4 * 0.2) = log 0.04 = -3.219.
    probs = np.array([[[0.5, 0.5, 0.0 + 1e-30], [0.4, 0.3, 0.3], [0.2, 0.7, 0.1]]], np.float32)
    logits = np.log(probs) + 3.0  # a shift changes nothing
    lp = ops.token_logprobs(jnp.asarray(logits), jnp.array([[0, 0, 0]]))
    np.testing.assert_allclose(float(lp.sum()), -3.2189, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_and_direct_paths_agree_in_value_and_gradient(dtype):
    # 37 positions in chunks of 8: the last chunk overlaps the one before it.
    key_l, key_t, key_w = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(key_l, (3, 37, 50), dtype) * 2
    targets = jax.random.randint(key_t, (3, 37), 0, 50)
    weights = jax.random.normal(key_w, (2, 3, 37))

    def total(lg, chunk):
        logps, entropy = ops.token_logprobs_and_entropy(lg, targets, temperature=0.8, chunk_size=chunk)
        return jnp.sum(weights[0] * logps**2 + weights[1] * entropy)

    direct, g_direct = jax.value_and_grad(total)(logits, None)
    chunked, g_chunked = jax.jit(jax.value_and_grad(total), static_argnums=1)(logits, 8)
    np.testing.assert_allclose(chunked, direct, rtol=1e-6)
    assert g_chunked.dtype == dtype
    if dtype == jnp.bfloat16:  # bf16 gradients round to 8 bits
        np.testing.assert_allclose(np.asarray(g_chunked, np.float32), np.asarray(g_direct, np.float32), atol=1e-2,
                                   rtol=1e-2)
        return
    bound = float32_gradient_bound(np.asarray(logits, np.float64) / 0.8, np.asarray(targets), np.asarray(weights),
                                   temperature=0.8)
    difference = np.abs(np.asarray(g_chunked, np.float64) - np.asarray(g_direct, np.float64))
    assert np.all(difference <= bound), (difference.max(), bound[np.unravel_index(difference.argmax(), bound.shape)])
    # not vacuous: the bound is a few float32 steps of the row's terms, far below a wrong chunk's error
    assert bound.max() < 1e-3 * np.abs(np.asarray(g_direct)).max()


def float32_gradient_bound(z: np.ndarray, targets: np.ndarray, weights: np.ndarray, *, temperature: float
                           ) -> np.ndarray:
    """How far two float32 evaluations of ``d/dlogits sum(w0 * logp**2 + w1 * H)`` may differ
    when they sum in different orders (the chunked path and the direct one, which XLA fuses
    differently from one release to the next), per element of ``[B, T, V]``.

    Per position, with ``z = logits / T``, ``p = softmax(z)``, ``l = z_y - lse(z)`` and
    ``zbar = sum_v p_v z_v``, the gradient is
    ``g_v = (2 w0 l (delta_vy - p_v) - w1 p_v (z_v - zbar)) / T``
    (``dl/dz_v = delta_vy - p_v``, ``dH/dz_v = -p_v (z_v - zbar)``). Its only reductions are
    ``lse`` and ``zbar``, each a float32 sum over the ``V`` logits: in any summation order
    it is within ``gamma_n * S`` of the exact sum (Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., eq. 4.4; ``gamma_n = n u / (1 - n u)``, ``u = 2^-24``,
    ``S`` the sum of the terms' magnitudes), with ``n = V + 2`` for the division by ``T``
    and the shift by the maximum before the sum. So ``d = gamma_n * M``, with
    ``M = max_v |z_v| + |lse|``, bounds the error of ``lse``, ``l`` and ``zbar`` alike; it
    moves ``p_v`` by ``p_v d`` (``exp`` of a shifted argument), and so ``g_v`` by at most
    ``(2 |w0| (|l| p_v d + d) + |w1| (p_v d |z_v - zbar| + p_v d)) / T``. Each path is
    within that of the exact value, so the two differ by twice it, plus the element-wise
    rounding of ``g_v``'s own few operations (``8 u |g_v|``). Computed in float64."""
    u = 2.0**-24
    vocab = z.shape[-1]
    gamma = (vocab + 2) * u / (1 - (vocab + 2) * u)
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    p = np.exp(z - lse[..., None])
    logp = np.take_along_axis(z, targets[..., None], -1)[..., 0] - lse
    zbar = np.sum(p * z, -1)
    d = gamma * (np.abs(z).max(-1) + np.abs(lse))[..., None]
    w0, w1 = np.abs(weights[0])[..., None], np.abs(weights[1])[..., None]
    one_path = (2 * w0 * (np.abs(logp)[..., None] * p * d + d) + w1 * (p * d * np.abs(z - zbar[..., None]) + p * d)
                ) / temperature
    onehot = np.arange(vocab) == targets[..., None]
    g = (2 * weights[0][..., None] * logp[..., None] * (onehot - p)
         - weights[1][..., None] * p * (z - zbar[..., None])) / temperature
    return 2 * one_path + 8 * u * np.abs(g)


# The public functions whose direct path holds a float32 [B, T, V] (token_logprobs alone does
# not: XLA fuses its softmax into the gradient it returns, 12 KB of temporaries here), each as a
# loss of (logits, targets, chunk_size).
CHUNKED_OUTPUTS = {
    "token_logprobs_and_entropy": lambda lg, tg, chunk: sum(ops.token_logprobs_and_entropy(lg, tg, chunk_size=chunk)),
    "entropy_from_logits": lambda lg, tg, chunk: ops.entropy_from_logits(lg, chunk_size=chunk),
}


@pytest.mark.parametrize("name", list(CHUNKED_OUTPUTS))
def test_chunked_path_never_builds_full_float32_log_softmax(name):
    # float32 logits: XLA's CPU backend widens a bf16 while-loop operand to f32, which
    # would measure that backend's artefact rather than this code.
    b, t, v = 2, 256, 1000
    logits = jax.ShapeDtypeStruct((b, t, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    full_f32 = b * t * v * 4

    def temp_bytes(chunk):
        def loss(lg, tg):
            return jnp.sum(CHUNKED_OUTPUTS[name](lg, tg, chunk))

        fn = jax.jit(jax.grad(loss))
        return fn.lower(logits, targets).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(None) >= full_f32  # the direct path holds at least one [B, T, V] f32
    chunk_f32 = b * 16 * v * 4
    assert temp_bytes(16) <= 4 * chunk_f32  # a few chunk-sized buffers, nothing [B, T, V]


def test_bad_inputs_name_the_argument():
    x, mask = batch()
    with pytest.raises(ValueError, match="valid: token-mean"):
        ops.aggregate(x, mask, mode="mean")
    with pytest.raises(ValueError, match="per_token must have rank 2"):
        ops.aggregate(x[0], mask[0])
    with pytest.raises(ValueError, match=r"per_token=\(4, 7\), mask=\(4, 6\)"):
        ops.aggregate(x, mask[:, :6])
    with pytest.raises(ValueError, match="logits must have rank 3"):
        ops.token_logprobs(jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="disagree"):
        ops.token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, m: ops.aggregate(x[None], m[None]), "per_token must have rank 2"),
        (lambda x, m: ops.aggregation_normalisers(m[0]), "mask must have rank 2"),
        (lambda x, m: ops.entropy_from_logits(x), "logits must have rank 3"),
        (lambda x, m: ops.token_logprobs_and_entropy(x[..., None, None], m.astype(int)), "logits must have rank 3"),
        (lambda x, m: ops.token_logprobs(x[..., None], m.astype(np.int32)[..., None]), "targets must have rank 2"),
    ],
    ids=["aggregate", "aggregation_normalisers", "entropy_from_logits", "token_logprobs_and_entropy", "token_logprobs"],
)
def test_wrong_rank_raises_naming_the_argument(call, message):
    x, mask = batch()
    with pytest.raises(ValueError, match=message):
        call(x, mask)
    with pytest.raises(ValueError, match=message):  # the check is static: it fires while tracing
        jax.jit(call)(x, mask)


def test_float_targets_are_refused():
    logits = jnp.zeros((2, 3, 5))
    with pytest.raises(ValueError, match="targets must be integer token ids; got dtype float32"):
        ops.token_logprobs(logits, jnp.zeros((2, 3)))


# --------------------------------------------------------------------------- edge counts and defaults
# Written against the survivors of a mutmut run over alignax/ops.py (issue 38,
# docs/mutation-testing.md): rows of one and two tokens, a single sequence, constant values,
# the arguments left at their defaults, and dtypes with x64 on.


def short_rows():
    """Rows of 0, 1, 2 and 5 counted tokens (T = 5); every column holds a counted token, so a
    count over the wrong axis (5 columns, not 3 rows) shows. Masked-out entries are 9."""
    x = np.array([[9.0, 9.0, 9.0, 9.0, 9.0],
                  [1.5, 9.0, 9.0, 9.0, 9.0],
                  [-0.8, 2.6, 9.0, 9.0, 9.0],
                  [0.3, -0.9, 1.7, -2.2, 0.5]], np.float32)
    mask = np.array([[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    return x, mask


def test_normalisers_count_tokens_and_non_empty_rows():
    x, mask = short_rows()
    norms = ops.aggregation_normalisers(mask)
    assert float(norms["num_tokens"]) == 8.0  # 0 + 1 + 2 + 5
    assert float(norms["num_seqs"]) == 3.0  # a row of one token counts, the empty one does not
    one = ops.aggregation_normalisers(mask[1:2])
    assert (float(one["num_tokens"]), float(one["num_seqs"])) == (1.0, 1.0)


@pytest.mark.parametrize("mode", ops.AGGREGATION_MODES)
def test_aggregate_rows_of_one_and_two_tokens_and_a_single_sequence(mode):
    x, mask = short_rows()
    for rows in (slice(0, 4), slice(1, 2), slice(2, 3), slice(0, 2)):  # all; one token; two; one + empty
        got = ops.aggregate(x[rows], mask[rows], mode=mode)
        np.testing.assert_allclose(got, references.aggregate(x[rows], mask[rows], mode), rtol=1e-6, err_msg=str(rows))
    # a shard of one token normalised by a global count of one token and one sequence
    got = ops.aggregate(x[1:2], mask[1:2], mode=mode, num_tokens=1.0, num_seqs=1.0)
    np.testing.assert_allclose(got, references.aggregate(x[1:2], mask[1:2], mode), rtol=1e-6)


def test_aggregate_defaults_to_token_mean():
    x, mask = short_rows()
    np.testing.assert_allclose(ops.aggregate(x, mask), references.aggregate(x, mask, "token-mean"), rtol=1e-6)


def test_masked_reductions_of_one_and_two_entries():
    x, mask = short_rows()
    np.testing.assert_allclose(ops.masked_mean(x, mask, axis=-1), [0.0, 1.5, 0.9, -0.12], rtol=1e-6, atol=1e-7)
    a, b = -0.8, 2.6  # row 2: two entries, mean 0.9, squared deviations 2 * 1.7^2
    np.testing.assert_allclose(ops.masked_var(x[2:3], mask[2:3]), 2 * 1.7**2, rtol=1e-6)  # / (n - 1) = 1
    np.testing.assert_allclose(ops.masked_var(x[2:3], mask[2:3], unbiased=False), 1.7**2, rtol=1e-6)
    assert float(ops.masked_var(x[1:2], mask[1:2])) == 0.0  # one entry: nothing to spread
    # the documented 0 is the result itself, not a quotient of the spread: even a lone inf
    # entry, whose spread inf - inf is NaN, gives 0
    lone_inf = np.array([[np.inf, 1.0]], np.float32), np.array([[1.0, 0.0]], np.float32)
    assert float(ops.masked_var(*lone_inf)) == 0.0
    white = ops.masked_whiten(x[2:3], mask[2:3], unbiased=False)  # (x - 0.9) / 1.7 = -1, +1
    np.testing.assert_allclose(white[0, :2], [(a - 0.9) / 1.7, (b - 0.9) / 1.7], rtol=1e-6)
    np.testing.assert_array_equal(white[0, 2:], 0.0)


def test_masked_whiten_biased_matches_loop():
    x, mask = batch(seed=6)
    vals = references.masked_values(x, mask)
    mean, var = references.mean(vals), references.variance(vals, ddof=0)
    white = ops.masked_whiten(x, mask, unbiased=False)
    want = np.where(mask > 0, (x - mean) / np.sqrt(var + 1e-8), 0.0)
    np.testing.assert_allclose(white, want, atol=1e-5)


def test_masked_whiten_of_constant_or_single_values_is_zero_not_nan():
    """``var = 0`` there: ``eps`` keeps ``rsqrt`` finite, so the result is exactly 0."""
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    for unbiased in (True, False):
        white = ops.masked_whiten(np.full((2, 3), 0.5, np.float32), mask, unbiased=unbiased)
        np.testing.assert_array_equal(white, np.zeros((2, 3)))
        single = ops.masked_whiten(np.array([[2.0, 7.0, -1.0]], np.float32), np.array([[0, 1, 0]], np.float32),
                                   unbiased=unbiased)
        np.testing.assert_array_equal(single, np.zeros((1, 3)))


def test_logprobs_and_entropy_default_to_temperature_one():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(2, 4, 6)).astype(np.float32) * 2
    targets = rng.integers(0, 6, size=(2, 4))
    want_lp, want_ent = ref_logprob_entropy(logits, targets)
    atol = 1e-6 * np.abs(logits).max()
    np.testing.assert_allclose(ops.entropy_from_logits(logits), want_ent, atol=atol)
    lp, ent = ops.token_logprobs_and_entropy(logits, targets)
    np.testing.assert_allclose(lp, want_lp, atol=atol)
    np.testing.assert_allclose(ent, want_ent, atol=atol)
    np.testing.assert_allclose(ops.token_logprobs(logits, targets), want_lp, atol=atol)


def test_reductions_and_normalisers_stay_float32_with_x64_on():
    x, mask = short_rows()
    x64, mask64 = x.astype(np.float64), mask.astype(np.float64)
    with jax.enable_x64(True):
        outs = [ops.masked_sum(x64, mask64), ops.masked_mean(x64, mask64), ops.masked_var(x64, mask64),
                ops.masked_whiten(x64, mask64), *ops.aggregation_normalisers(mask64).values()]
        outs += [ops.aggregate(x64, mask64, mode=mode) for mode in ops.AGGREGATION_MODES]
        assert all(o.dtype == jnp.float32 for o in outs), [o.dtype for o in outs]


def test_a_chunk_size_at_or_over_the_sequence_length_takes_the_whole_sequence():
    """T = 4 and V = 9: chunks of 4 and 6 positions cover the sequence in one piece (a chunk
    is never longer than T, however it compares with V)."""
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(2, 4, 9)).astype(np.float32) * 2
    targets = rng.integers(0, 9, size=(2, 4))
    want_lp, want_ent = ref_logprob_entropy(logits, targets)
    for chunk in (4, 6):
        lp, ent = ops.token_logprobs_and_entropy(logits, targets, chunk_size=chunk)
        np.testing.assert_allclose(lp, want_lp, atol=1e-5, err_msg=str(chunk))
        np.testing.assert_allclose(ent, want_ent, atol=1e-5, err_msg=str(chunk))


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_logprobs_and_entropy_stay_float32_with_x64_on(chunk_size):
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(2, 7, 5)) * 2  # float64
    targets = rng.integers(0, 5, size=(2, 7))
    want_lp, want_ent = ref_logprob_entropy(logits, targets)
    with jax.enable_x64(True):
        lp, ent = ops.token_logprobs_and_entropy(logits, targets, chunk_size=chunk_size)
        assert lp.dtype == ent.dtype == jnp.float32, (lp.dtype, ent.dtype)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)


def test_a_chunk_of_one_position_is_accepted():
    """The smallest positive chunk_size: one position at a time, the same values."""
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(2, 3, 4)).astype(np.float32)
    targets = rng.integers(0, 4, size=(2, 3))
    want_lp, want_ent = ref_logprob_entropy(logits, targets)
    lp, ent = ops.token_logprobs_and_entropy(logits, targets, chunk_size=1)
    np.testing.assert_allclose(lp, want_lp, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=1e-5)
