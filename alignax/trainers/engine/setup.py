"""What every trainer shares: building the model and tokenizer from a ModelSpec, splitting
it into a graph and trainable parameters, placing batches on the mesh, and the per-token
log-probs of a batch's response tokens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax import models
from alignax.config import ConfigError
from alignax.models import registry
from alignax.models.hf import read_config
from alignax.models.lora import LoraConfig, with_adapters
from alignax._checks import check_choice
from alignax.parallel.multihost import place_rows
from alignax.parallel.placement import last_of_each_process, processes_of, split_devices
from alignax.parallel.sharding import make_mesh, mesh_for_shape
from alignax.trainers.config import MeshSection, ModelSpec
from alignax.trainers.engine.precision import PrecisionConfig, frozen_params

log = logging.getLogger("alignax")


def build_mesh(section: MeshSection, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The run's mesh (``mesh.shape``, ``mesh.dcn_shape``) over ``devices`` (default:
    every device); see :func:`alignax.parallel.sharding.mesh_for_shape`."""
    return mesh_for_shape(section.shape, section.dcn_shape, devices=devices)


def build_meshes(config) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
    """``(training mesh, sub-mesh or None)`` of a run: with ``placement.submesh`` the
    frozen models placed on ``submesh`` get devices of their own and ``mesh:`` spans the
    rest (:func:`alignax.parallel.placement.split_devices`)."""
    training, apart = split_devices(config.placement)
    training, _ = split_sampler_devices(config, training)  # rollout.async.devices: the sampler's own
    return (build_mesh(config.mesh, training),
            None if apart is None else make_mesh(config.placement.submesh, devices=apart))


def split_sampler_devices(config, devices: Sequence[jax.Device]) -> tuple[list[jax.Device], list[jax.Device] | None]:
    """``(the learner's devices, the asynchronous sampler's own or None)`` of ``devices``
    (the training devices, a sub-mesh's taken out): under ``rollout.async.devices: S`` with
    ``max_staleness >= 1`` the last ``S / P`` of each of the ``P`` processes are the
    sampler's, as many as the learner keeps (its weights move one shard to one device).
    With one device per process there is one group: ``None``, time-sliced, and a warning."""
    section = config.rollout.async_
    count = section.devices if section.max_staleness else 0
    if not count:
        return list(devices), None
    local = processes_of(devices)
    if max(len(ds) for ds in local) == 1:
        log.warning("rollout.async.devices=%d: one device per process is one group; the sampler is time-sliced "
                    "with the learner", count)
        return list(devices), None
    split = last_of_each_process(devices, count)
    if split is None or len(split[0]) != len(split[1]):
        raise ConfigError(f"rollout.async.devices={count}: the sampler takes the same number of devices from each of "
                          f"the {len(local)} processes and the learner keeps as many (the weights move one shard to "
                          f"one device); the processes have {[len(ds) for ds in local]} training devices, so use "
                          f"{len(devices) // 2}")
    return split


def model_directory(spec: ModelSpec) -> str:
    """The local Hugging Face folder of ``spec.name`` (registry names are converted once)."""
    return str(registry.model_directory(spec.name, key="model.name"))


@contextlib.contextmanager
def reading_model_folder(spec: ModelSpec, what: str) -> Iterator[None]:
    """A ``ValueError`` (a corrupt file, an unsupported ``model_type``...) or ``OSError``
    while reading ``what`` of the model folder becomes a :class:`ConfigError` naming
    ``model.name`` and the folder: input the user fixes, printed in one line."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as err:
        raise ConfigError(f"model.name={spec.name}: {what} in {model_directory(spec)} cannot be read: "
                          f"{type(err).__name__}: {err}") from err


def load_tokenizer(spec: ModelSpec):
    with reading_model_folder(spec, "the tokenizer"):
        return registry.load_tokenizer(spec.name, key="model.name")


def build_model(spec: ModelSpec, *, kind: str = "causal_lm", mesh: jax.sharding.Mesh | None = None,
                precision: PrecisionConfig = PrecisionConfig(), lora: LoraConfig | None = None) -> nnx.Module:
    """The model of ``kind`` (``alignax.models.MODEL_KINDS``) for ``spec``, sharded over ``mesh``,
    its weights in ``precision.param_dtype`` computing in ``precision.compute_dtype``; with
    ``lora``, fresh adapters on its projections (:func:`alignax.models.lora.with_adapters`).

    ``random_init`` builds a fresh model from the named config with fields replaced. A
    reward model started from a causal-LM checkpoint keeps its trunk and gets a fresh
    score head (seeded by ``spec.seed``); value heads start at zero.
    """
    check_choice("model kind", kind, tuple(models.MODEL_KINDS))
    for old, new in (("param_dtype", "param_dtype"), ("dtype", "compute_dtype")):
        if getattr(spec, old) != "float32":
            raise ValueError(f"model.{old} is no longer read: set precision.{new} (got model.{old}="
                             f"{getattr(spec, old)})")
    directory = model_directory(spec)
    hf_config = _with_router_coef(read_config(directory, name=spec.name), spec)
    policy = dict(**precision.model_dtypes(), scan_layers=spec.scan_layers, remat=spec.remat,
                  attention=attention_implementation(spec.attention, precision.compute_dtype))
    with reading_model_folder(spec, "the model (config.json and weights)"):
        if spec.attention == "auto" and models.ModelConfig.from_hf_config(
                {**hf_config, **(spec.random_init or {})}).needs_xla_attention:
            policy["attention"] = "xla"  # sliding windows or soft caps: no fused kernel takes them
        if spec.random_init is not None:
            config = models.ModelConfig.from_hf_config({**hf_config, **spec.random_init}, **policy)
            model = models.create_model(config, kind=kind, seed=spec.seed, mesh=mesh)
        else:
            tensors = models.read_hf_tensors(directory)
            new_head = kind == "reward" and "score.weight" not in tensors
            model = models.from_hf_state_dict(hf_config, tensors, kind=kind, mesh=mesh, new_head=new_head,
                                              seed=spec.seed, **policy)
    return model if lora is None else with_adapters(model, lora, mesh=mesh)


def _with_router_coef(hf_config: dict, spec: ModelSpec) -> dict:
    """``hf_config`` with ``model.router_aux_loss_coef`` in place of the checkpoint's, when set."""
    if spec.router_aux_loss_coef is None:
        return hf_config
    merged = {**hf_config, **(spec.random_init or {})}
    # the config's own reading: a qwen3_moe config without num_experts has transformers' 128
    if not models.ModelConfig.from_hf_config(merged).num_experts:
        raise ValueError(f"model.router_aux_loss_coef={spec.router_aux_loss_coef} is for mixture-of-experts models; "
                         f"model.name={spec.name} ({merged.get('model_type')}) has no experts")
    return {**hf_config, "router_aux_loss_coef": float(spec.router_aux_loss_coef)}


def attention_implementation(choice: str, compute_dtype: str, backend: str | None = None) -> str:
    """``model.attention`` resolved for this backend: ``auto`` is ``cudnn`` on a GPU with
    bfloat16 compute, ``splash`` on a TPU, else ``xla``; ``cudnn`` off a GPU and ``splash``
    off a TPU (where Pallas would interpret it, very slowly) are errors naming the key."""
    backend = backend or jax.default_backend()
    if choice == "auto":
        if backend == "tpu":
            return "splash"
        return "cudnn" if backend == "gpu" and compute_dtype == "bfloat16" else "xla"
    if choice == "cudnn" and (backend != "gpu" or compute_dtype not in ("bfloat16", "float16")):
        raise ValueError(f"model.attention=cudnn needs a GPU and precision.compute_dtype=bfloat16; this run has "
                         f"backend {backend!r} and compute dtype {compute_dtype!r} (use model.attention=xla or auto)")
    if choice == "splash" and backend != "tpu":
        raise ValueError(f"model.attention=splash is the TPU kernel; this run's backend is {backend!r} "
                         "(use model.attention=xla or auto)")
    return choice


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, trainable params, everything else)``; ``nnx.merge`` puts them back."""
    return nnx.split(model, nnx.Param, ...)


def build_frozen_params(spec: ModelSpec, *, kind: str, mesh: jax.sharding.Mesh,
                        precision: PrecisionConfig) -> nnx.State:
    """The params of the model ``spec`` names, built on ``mesh`` as a frozen copy in
    ``precision.frozen_dtype``: a reference built where it runs (its own sub-mesh), the same
    weights as the policy's initial ones (the same folder, or the same seed)."""
    model = build_model(spec, kind=kind, mesh=mesh, precision=precision)
    return frozen_params(split_params(model)[1], precision)


class BatchPlacer:
    """Host batches (dicts of NumPy arrays) → device arrays sharded over the batch axes.

    Each process passes its own rows of the global batch (``alignax.data`` reads ``B / P``
    rows per process); the arrays placed are global (``B`` rows). Non-array fields
    (strings, tuples of reference answers) stay on the host and are
    dropped from what goes to the device.
    """

    def __init__(self, mesh: jax.sharding.Mesh):
        self.mesh = mesh

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        placed = {}
        for key, value in batch.items():
            if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
                continue
            placed[key] = place_rows(value, self.mesh)
        return placed


def response_hidden(model: nnx.Module, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                    response_mask: jax.Array, *, window: int | None = None, segment_ids: jax.Array | None = None):
    """The final hidden states that score the response tokens: ``(hidden [B, W, D],
    targets [B, W], mask [B, W] float32)``, position ``t`` predicting ``targets[:, t]``;
    ``W = T - 1`` without ``window``, else the ``window`` positions from each row's first
    response token on (:func:`response_logps`). ``segment_ids [B, T]``: rows of several
    examples (``data.packing``; :mod:`alignax.data.example_packing`), scored whole."""
    if segment_ids is not None and window is not None:
        raise ValueError("a packed row holds several responses: it is scored whole (window None)")
    hidden = model(tokens, positions, attention_mask, segment_ids=segment_ids, return_logits=False).hidden[:, :-1]
    targets = tokens[:, 1:]
    mask = response_mask[:, 1:].astype(jnp.float32)
    if window is not None and window < targets.shape[1]:
        first = jnp.argmax(mask > 0, axis=1)  # first scored position of each row
        index = jnp.minimum(first[:, None] + jnp.arange(window)[None, :], targets.shape[1] - 1)
        in_range = (first[:, None] + jnp.arange(window)[None, :]) < targets.shape[1]
        hidden = jnp.take_along_axis(hidden, index[:, :, None], axis=1)
        targets = jnp.take_along_axis(targets, index, axis=1)
        mask = jnp.take_along_axis(mask, index, axis=1) * in_range
    return hidden, targets, mask


def response_logps(
    model: nnx.Module,
    tokens: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    response_mask: jax.Array,
    *,
    chunk_size: int | None = None,
    window: int | None = None,
    with_entropy: bool = False,
    segment_ids: jax.Array | None = None,
):
    """Per-token log-probs of the response tokens given their prefixes, and their mask.

    Without ``window``: ``(logps [B, T-1], mask [B, T-1])`` for ``tokens[:, 1:]``, with
    ``mask = response_mask[:, 1:]`` (position ``t`` scores the token at ``t + 1``).

    With ``window = W``: only the ``W`` positions from each row's first response token
    on are scored — ``(logps [B, W], mask [B, W])`` — so the LM head (a ``V``-wide
    matmul per position) never runs over the prompt. ``W`` must be at least the longest
    response: the trainers pass ``data.max_response_length``, which the data pipeline
    enforces on every example.

    ``with_entropy`` adds the entropy of each scored position's distribution. Float32
    whatever the compute dtype. ``segment_ids``: packed rows (:func:`response_hidden`).
    """
    hidden, targets, mask = response_hidden(model, tokens, positions, attention_mask, response_mask, window=window,
                                            segment_ids=segment_ids)
    result = models.token_logprobs_from_hidden(hidden, model, targets, chunk_size=chunk_size, with_entropy=with_entropy)
    if with_entropy:
        logps, entropy = result
        return logps, entropy, mask
    return result, mask


def sequence_logps(token_logps: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of masked token log-probs [B], number of masked tokens [B])``."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask > 0, token_logps, 0.0), axis=-1), jnp.sum(mask, axis=-1)
