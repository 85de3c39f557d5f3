"""The public pieces of a program of your own: a run's model, tokenizer and mesh as its
trainer builds them, the log-probs of a batch's response tokens, and on-policy pairs.

:mod:`alignax.trainers.api` runs a recipe whole (``train``, ``evaluate``, ``export``) and
``build_trainer`` hands out its trainer: ``trainer.start()`` returns ``(state, frozen)`` and
``trainer.step(state, frozen, batch)`` is the compiled step, in both wings. A script that
does something the trainers do not (a study, a benchmark, a demo that judges before and
after) takes the parts below; ``tools/`` uses only these, the api and the public packages
(``alignax.models``, ``alignax.data``, ``alignax.evaluation``, ``alignax.sampling``...), so
the engine's rooms stay free to move.
"""

from __future__ import annotations

import jax
from flax import nnx

from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import setup
from alignax.trainers.engine.setup import response_logps, sequence_logps
from alignax.trainers.iterative import sample_pairs

__all__ = ["load_model", "load_tokenizer", "run_mesh", "response_logps", "sequence_logps", "sample_pairs"]


def load_model(config: TrainConfig, *, kind: str = "causal_lm", mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """The model ``config.model`` names, of ``kind`` (``alignax.models.MODEL_KINDS``), as the
    run's trainer builds it: weights in ``precision.param_dtype``, computing in
    ``precision.compute_dtype``, sharded over ``mesh`` (None: unsharded, one device).

    Pass the run's own mesh (:func:`run_mesh`) when the model goes into that run's compiled
    functions: arrays laid out as the trainer lays them out compile once, not twice."""
    return setup.build_model(config.model, kind=kind, mesh=mesh, precision=config.precision)


def load_tokenizer(config: TrainConfig):
    """The tokenizer of ``config.model`` (a registry model or a local Hugging Face folder)."""
    return setup.load_tokenizer(config.model)


def run_mesh(config: TrainConfig) -> jax.sharding.Mesh:
    """The mesh a run of ``config`` trains on (``mesh.shape``, ``mesh.dcn_shape``) over every
    device; see :func:`alignax.parallel.sharding.mesh_for_shape`."""
    return setup.build_mesh(config.mesh)
