"""The DPO trainer on a (2, 2, 2) mesh of 8 fake CPU devices equals the one-device run."""

import numpy as np
import pytest

from tests.fake_devices import mesh_equality


@pytest.mark.xdist_group("mesh-equality")
def test_dpo_steps_on_a_mesh_match_one_device():
    out = mesh_equality("mesh_dpo_check")
    assert out["devices"] == 8
    np.testing.assert_allclose(out["loss_sharded"], out["loss_single"], rtol=1e-5)
    assert out["max_param_diff"] < 5e-5  # two Adam steps of lr 3e-3: float32 reduction order only
    assert out["eval_accuracy_sharded"] == out["eval_accuracy_single"]
    # 4 pairs on 8 batch devices: the placement drops the axis that does not divide them (it
    # raised jax's IndivisibleError before) and the steps equal one device's
    np.testing.assert_allclose(out["few_rows_loss_sharded"], out["few_rows_loss_single"], rtol=1e-5)
    assert out["few_rows_loss_single"][1] < out["few_rows_loss_single"][0]  # a step was taken
    # the embedding is split over fsdp (and vocab over tensor), not replicated
    assert "fsdp" in out["embed_spec"] and out["num_devices_of_embed"] == 8
