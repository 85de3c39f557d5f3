"""A GRPO step, sampling included, on a (2, 2, 2) mesh of 8 fake CPU devices equals the
one-device step for the same seed."""

from importlib.metadata import version

import numpy as np
import pytest

from tests.fake_devices import mesh_equality


@pytest.mark.xdist_group("mesh-equality")
def test_grpo_steps_on_a_mesh_match_one_device():
    out = mesh_equality("mesh_grpo_check")
    assert out["devices"] == 8 and out["sharded_param_devices"] == 8
    # same samples (same rewards and lengths), same losses and updates within float32
    assert out["sharded/reward/total"] == out["single/reward/total"]
    assert out["sharded/response/length_mean"] == out["single/response/length_mean"]
    for key in ("loss", "grad_norm", "kl/ref_seq", "entropy"):
        np.testing.assert_allclose(out[f"sharded/{key}"], out[f"single/{key}"], rtol=1e-4, atol=1e-6, err_msg=key)
    # The parameters after four Adam steps (2 rollouts x 2 minibatches, lr 2e-2), bounded by
    # what float32 summation order can do, derived rather than set (issue 39):
    # - the mesh splits the sums a gradient element is made of (one term per token of the
    #   update's 8 rows: K = 8 * 32 = 256) into per-shard partial sums; summing K float32
    #   terms in another order changes the result by a random walk of K roundings, about
    #   sqrt(K) * 2**-24 of its size (9.5e-7 here);
    # - Adam divides by sqrt(v) + eps, so noise delta in an element g moves its update by
    #   ~ lr * delta / |g| (small |g| dominate), and the moved parameters feed the later
    #   gradients and rollouts: no closed form, so the check runs it. A third run, on one
    #   device, adds Gaussian noise of sqrt(K) * 2**-24 * rms(g) to each gradient tensor at
    #   every update (tests/mesh_grpo_check.py, float32_noise_run); the mesh may move the
    #   parameters no further from one device than that noise does.
    # Measured (mesh / noise run): p99.9 4.11e-5 / 1.75e-4 on jax 0.10.2 and 0.11.2, 6.33e-5 /
    # 1.80e-4 on 0.12.1; max 8.23e-5 / 3.34e-4 and 1.24e-4 / 3.44e-4. With SGD at lr 1 (the
    # difference linear in the noise: `python tests/mesh_grpo_check.py --sgd`), 3.7e-8 /
    # 9.9e-8 and 4.1e-8 / 1.0e-7: the mesh's own gradient noise is 40% of the model's, the
    # same share as after Adam. A mesh that sums something else (noise 10x float32's in its
    # gradients, or a wrong micro-batch split) lands far outside (docs/jax-versions.md).
    noise = {k.removeprefix("float32_noise/"): v for k, v in out.items() if k.startswith("float32_noise/")}
    assert noise["reduction_length"] == 8 * (24 + 8) and noise["noise_relative"] == np.sqrt(8 * 32) * 2.0**-24, noise
    assert noise["reward/total"] == out["single/reward/total"]  # the same samples, so only the noise differs
    assert out["param_diff_p999"] < noise["param_diff_p999"], (out["param_diff_p999"], noise)
    assert out["max_param_diff"] < noise["max_param_diff"], (out["max_param_diff"], noise)


@pytest.mark.xdist_group("mesh-equality")
def test_micro_batches_are_spread_over_the_batch_shards_without_rematerialization():
    """grad_accum_steps=4 on (2, 2, 2): each micro-batch takes rows from every batch shard
    (shard k holds rows 4k..4k+3), so the partitioner never replicates a micro-batch; the
    contiguous split (micro-batch a = rows 4a..4a+3, one shard) made XLA print 7
    "Involuntary full rematerialization" warnings compiling this GRPO step."""
    out = mesh_equality("mesh_grpo_check")
    assert out["micro_rows"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert out["micro_joined"] == list(range(16))
    assert out["sharded_involuntary_remat"] == 0


@pytest.mark.xdist_group("mesh-equality")
def test_sampler_on_its_own_mesh_decodes_from_a_compute_dtype_copy():
    """rollout.mesh=(2, 1, 4) with float32 params on (1, 8, 1) computing in bfloat16: the
    sampler's weights are the training kernels rounded to bfloat16 (norm scales stay
    float32), laid out on its own mesh, and they sample what the training params sample
    on the training mesh (same prompts and key)."""
    out = {k.removeprefix("sampler_copy/"): v for k, v in mesh_equality("mesh_grpo_check").items()
           if k.startswith("sampler_copy/")}
    assert out["copy_kernel_dtypes"] == ["bfloat16"] and out["copy_other_dtypes"] == ["float32"], out
    assert out["copy_mesh"] == [2, 1, 4]
    assert out["copy_max_diff"] == 0.0  # exactly the cast, nothing lost in the reshard
    assert out["rows"] == 32 and out["tokens_equal"] == 1.0 and out["lengths_equal"], out
    # the decoder casts each kernel to bfloat16 where it uses it, so only the order of the
    # sums differs (heads split over 4 devices instead of weights gathered): float32 noise
    # on jaxlib 0.10. The CPU backend of jaxlib 0.12 rounds each device's partial sums of
    # the head-split projections to bfloat16 before the tensor all-reduce (0.10's fused dot
    # kept them float32; seen in the compiled HLO): bfloat16 rounding, 1.0e-3 measured.
    # jaxlib 0.11.2 measures 1.04e-3, the same bfloat16 scale (its HLO not read).
    noise = 1e-5 if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11) else 3e-3
    assert out["max_sampler_logp_diff"] < noise, out


@pytest.mark.xdist_group("mesh-equality")
def test_optimal_token_baseline_statistics_on_a_mesh_match_one_device():
    """The optimal token baseline's pass (``log pi(y)``, ``sum pi^2``, rows sharded over the
    (2, 2, 2) mesh, packed groups) and its advantages, priced from the same samples and
    weights, equal one device's within float32 noise. Measured: 3.0e-8 (``sum pi^2`` in
    [0.03, 1]), 4.8e-7 (log-probs of a few nats), 1.5e-8 (advantages up to 0.2)."""
    out = {k.removeprefix("otb/"): v for k, v in mesh_equality("mesh_grpo_check").items() if k.startswith("otb/")}
    assert out["devices"] == 8 and out["tokens"] > 0 and out["sum_pi_squared_min"] < 0.5, out
    assert out["advantage_abs_max"] > 1e-2, out  # the advantages are live, so their agreement says something
    assert out["max_sum_pi_squared_diff"] < 1e-6, out
    assert out["max_stat_logps_diff"] < 1e-5, out
    assert out["max_advantages_diff"] < 1e-6, out


@pytest.mark.xdist_group("mesh-equality")
def test_ppo_steps_with_a_separate_critic_on_a_mesh_match_one_device():
    out = mesh_equality("mesh_ppo_check")
    assert out["devices"] == 8
    assert out["sharded_policy_devices"] == 8 and out["sharded_critic_devices"] == 8
    assert out["sharded_pack_group"] == 1  # packed groups would not split over the 4 batch devices
    # same samples, so the same rewards and lengths exactly
    assert out["sharded/reward/total"] == out["single/reward/total"]
    assert out["sharded/response/length_mean"] == out["single/response/length_mean"]
    assert out["single/epochs_run"] == out["sharded/epochs_run"] == [2.0, 2.0]
    assert min(out["single/grad_norm"]) > 0 and min(out["single/advantages/abs_mean"]) > 0  # not a no-op
    for key in ("loss", "grad_norm", "value/loss", "pg_loss", "kl/ref_seq", "entropy", "advantages/abs_mean",
                "approx_kl"):
        np.testing.assert_allclose(out[f"sharded/{key}"], out[f"single/{key}"], rtol=1e-4, atol=1e-6, err_msg=key)
    # Eight Adam steps at lr 2e-2 (2 rollouts x 2 epochs x 2 minibatches) for the policy and
    # the critic, bounded as the GRPO test bounds its four: a third run, on one device, adds
    # Gaussian noise of sqrt(K) * 2**-24 * rms(g) to every gradient tensor (the policy's and
    # the critic's, through the trainer's optimiser) at every update, K = 4 rows x 32 tokens
    # = 128 the longest sum the mesh splits (tests/mesh_ppo_check.py); the mesh may move each
    # model's parameters no further from one device than that noise does. Entries with an
    # exactly-zero gradient get no noise (the critic's embedding rows of absent tokens: 0 in
    # any order; with noise there Adam moved them by up to 0.10, a bound no mesh could fail).
    # Measured (mesh / noise run), jax 0.10.2 and 0.12.1: policy p99.9 7.7e-7 and 3.5e-6 /
    # 1.7e-5, max 2.5e-6 and 1.1e-5 / 6.7e-5 (6.8e-5); critic p99.9 7.8e-7 and 6.3e-7 /
    # 2.7e-6 (2.6e-6), max 4.3e-6 and 1.0e-6 / 1.7e-5. The hand-set 5e-5 this replaces was 14
    # times the largest p99.9 measured; the derived bounds are 4.8 (policy) and 3.4 (critic).
    noise = {k.removeprefix("float32_noise/"): v for k, v in out.items() if k.startswith("float32_noise/")}
    assert noise["reduction_length"] == 4 * (24 + 8) and noise["noise_relative"] == np.sqrt(4 * 32) * 2.0**-24, noise
    assert noise["reward/total"] == out["single/reward/total"]  # the same samples, so only the noise differs
    for part in ("policy", "critic"):
        assert out[f"{part}_p999_diff"] < noise[f"{part}_p999_diff"], (part, out[f"{part}_p999_diff"], noise)
        assert out[f"{part}_max_diff"] < noise[f"{part}_max_diff"], (part, out[f"{part}_max_diff"], noise)
