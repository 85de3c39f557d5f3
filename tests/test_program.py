"""alignax.trainers.program: a run's model, tokenizer and mesh are the ones its trainer builds.

A script of tools/ (or a user's) that judges a model before training, or scores with it,
must see the weights the trainer starts from, at the run's precision; otherwise its
"before" figures belong to another model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from alignax.trainers.api import build_trainer
from alignax.trainers.program import load_model, load_tokenizer, run_mesh
from tests.support.trainer_helpers import separable_pairs, tiny_config


def leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_gives_the_trainers_starting_weights_at_the_runs_precision(tmp_path, toy_model, dtype):
    config = tiny_config(tmp_path, "dpo", model_dir=toy_model,
                         overrides=(f"precision.param_dtype={dtype}", f"precision.compute_dtype={dtype}"))
    trainer = build_trainer(config, records=separable_pairs(8))
    ours = nnx.state(load_model(config), nnx.Param)
    theirs = trainer.params
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert {x.dtype for x in leaves(ours)} == {jax.numpy.dtype(dtype)}
    for mine, trainers in zip(leaves(ours), leaves(theirs), strict=True):
        np.testing.assert_array_equal(mine, trainers)


def test_load_tokenizer_and_run_mesh_are_the_runs(tmp_path, toy_model):
    config = tiny_config(tmp_path, "dpo", model_dir=toy_model)
    trainer = build_trainer(config, records=separable_pairs(8))
    assert load_tokenizer(config).get_vocab() == trainer.tokenizer.get_vocab()
    mesh = run_mesh(config)
    assert dict(mesh.shape) == dict(trainer.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert list(mesh.devices.flat) == list(trainer.mesh.devices.flat)
