"""A GRPO step, sampling included, on a (2, 2, 2) mesh of 8 fake CPU devices equals the
one-device step for the same seed."""

import numpy as np

from tests.fake_devices import run_check


def test_grpo_steps_on_a_mesh_match_one_device():
    out = run_check("mesh_grpo_check.py")
    assert out["devices"] == 8 and out["sharded_param_devices"] == 8
    # same samples (same rewards and lengths), same losses and updates within float32
    assert out["sharded/reward/total"] == out["single/reward/total"]
    assert out["sharded/response/length_mean"] == out["single/response/length_mean"]
    for key in ("loss", "grad_norm", "kl/ref_seq", "entropy"):
        np.testing.assert_allclose(out[f"sharded/{key}"], out[f"single/{key}"], rtol=1e-4, atol=1e-6, err_msg=key)
    # Four Adam steps at lr 2e-2 (2 rollouts x 2 minibatches, groups packed): Adam moves an
    # entry by ~lr * g / |g|, so float32 noise in a near-zero gradient entry (a few of the
    # 2048 of one toy MLP kernel) moves it by up to ~2e-4; 99.9% of entries agree to ~1e-5.
    assert out["param_diff_p999"] < 5e-5
    assert out["max_param_diff"] < 1e-3
