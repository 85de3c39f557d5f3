"""LoRA in the engine (the ``lora:`` section): what a run trains, where its frozen base
lives, and its reference.

- Trained: the adapter weights (:class:`alignax.models.lora.LoRAParam`) and, for a reward
  model, its score head (a fresh head has to learn; PEFT's ``modules_to_save``). The train
  state, its gradients, optimiser state and checkpoints hold these alone.
- The base (every other parameter) is frozen, held in ``precision.frozen_dtype`` (default
  ``param_dtype``), and passed to each jitted function as ``frozen["base"]``, an argument:
  a closed-over array would be compiled into the program as a constant, a second copy.
- The reference of DPO/KTO/GRPO/PPO is the same base with the adapters off: the trained
  leaves replaced by zeros (:func:`alignax.models.lora.adapters_off`), so its outputs are
  the base's bit for bit. Its weight arrays are the base's own buffers: no second copy of
  the model; only the adapter-sized zeros are new (and saved once as the run's reference).
  Distillation's teacher is a frozen model of its own in the reference's place: it is not
  merged with the base (``frozen_base(base, None)``, the teacher placed beside it).
- QLoRA (``lora.quantize``): the base's projection kernels are codes and scales
  (:mod:`alignax.models.quant`), frozen like the rest of the base and never cast to
  ``precision.frozen_dtype``; the reference is the same quantised base, adapters off. They
  are not checkpointed: quantisation is deterministic, so a resumed run rebuilds the
  identical codes from the base checkpoint (as it reloads an unquantised base).
- PPO's critic (``ppo.critic: adapter``): a value model whose decoder is the policy's frozen
  base (the same buffers, :func:`critic_base`) with an adapter and a value head of its own,
  trained beside the policy's adapters (:func:`critic_adapter`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

import jax

from alignax.models.lora import LoRAParam, LoraConfig, adapter_dropout, adapters_off

TRAINED_HEADS = ("score",)  # a reward model's head trains beside its adapters
TRAINABLE = nnx.Any(LoRAParam, *(nnx.PathContains(name) for name in TRAINED_HEADS))


def split_trainable(params: nnx.State, lora: LoraConfig | None) -> tuple[nnx.State, nnx.State | None]:
    """``(trained params, frozen base)``; without LoRA every param is trained (base ``None``)."""
    if lora is None:
        return params, None
    return nnx.split_state(params, TRAINABLE, ...)


def with_base(fn: Callable, *, merge: Callable = nnx.merge_state) -> Callable:
    """``fn(params, frozen, *args)`` called with the whole model's params: the trained ones
    merged with ``frozen["base"]`` (``merge(params, base)``) when the run has a frozen base."""

    def wrapped(params, frozen, *args):
        if "base" in frozen:
            params = merge(params, frozen["base"])
        return fn(params, frozen, *args)

    return wrapped


DROPOUT_STREAM = 0x10A  # the dropout masks' stream of the step's rng


def with_dropout(loss_fn: Callable, lora: LoraConfig | None) -> Callable:
    """The training ``loss_fn(params, frozen, batch, normalisers, rng)`` with adapter dropout
    (``lora.dropout``) drawn from ``rng``; unchanged without LoRA or dropout. (The
    reference inside the loss has its adapters at zero: dropout changes nothing there.)"""
    if lora is None or not lora.dropout:
        return loss_fn

    def wrapped(params, frozen, batch, normalisers, rng):
        with adapter_dropout(jax.random.fold_in(rng, DROPOUT_STREAM)):
            return loss_fn(params, frozen, batch, normalisers, rng)

    return wrapped


def reference_adapters(trained: nnx.State) -> nnx.State:
    """The reference's own leaves: the trained leaves switched off (zeros)."""
    return adapters_off(trained)


def frozen_base(base: nnx.State | None, reference: Any) -> dict[str, Any]:
    """``{"base": base, "reference": base with the adapters off}`` (one set of weight
    buffers); ``{}`` without a base. ``reference``: :func:`reference_adapters`, or ``None``
    when the run has no reference or its reference is a model of its own (a teacher, which
    the caller places beside the base)."""
    if base is None:
        return {}
    out: dict[str, Any] = {"base": base}
    if reference is not None:
        out["reference"] = nnx.merge_state(reference, base)
    return out


# ---------------------------------------------------------------------------- PPO's critic
CRITIC_SEED_OFFSET = 1  # the critic adapter's A are drawn from lora.seed + 1: not the policy's


def critic_adapter(model_config, *, mesh: jax.sharding.Mesh | None = None
                   ) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """PPO's ``critic: adapter``: ``(graphdef, trained params, rest)`` of a critic
    (:class:`alignax.models.modeling.ValueModel`) of the policy's ``model_config`` (its
    ``lora`` included) whose trained params are its own fresh adapters (``B = 0``, ``A``
    seeded by ``lora.seed + 1``) and a zero value head. Its decoder is the policy's frozen
    base (:func:`critic_base`): no second copy of the base exists. Initialised in one
    jitted program (XLA drops the unused base init), sharded by the logical rules on ``mesh``."""
    from alignax.models.modeling import ValueModel
    from alignax.parallel.sharding import tree_shardings

    seed = model_config.lora.seed + CRITIC_SEED_OFFSET
    graphdef, abstract, rest = nnx.split(nnx.eval_shape(lambda: ValueModel(model_config, rngs=nnx.Rngs(seed))),
                                         nnx.Param, ...)
    trained_filter = nnx.Any(LoRAParam, nnx.PathContains("value_head"))

    def init():
        return nnx.state(ValueModel(model_config, rngs=nnx.Rngs(seed)), trained_filter)

    out_shardings = tree_shardings(jax.eval_shape(init), mesh) if mesh is not None else None
    del abstract
    return graphdef, jax.jit(init, out_shardings=out_shardings)(), rest


def critic_base(base: nnx.State) -> nnx.State:
    """The critic's frozen params in a LoRA PPO run: the policy base's decoder (``model``),
    the same arrays (the LM head is the policy's alone)."""
    return nnx.State({"model": base["model"]})
