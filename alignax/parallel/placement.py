"""Where frozen models and the optimiser state live between uses (the ``placement:`` section).

``host``: a model's weights are held in host memory (``pinned_host``, JAX's memory kinds)
with the partition specs they have on the device, so each device holds none of them
between uses; every jitted program that runs the model moves them into device memory
inside the program (:func:`to_device`, right before the forward pass) and XLA frees that
copy once the forward is done. The price is one host-to-device transfer of the weights
per program run (per micro-batch of a step whose loss reads the reference); on a GPU or
TPU it overlaps with compute only as far as XLA's scheduler manages.

``optimizer_state: host``: the optimiser state (Adam's moments, and the float32 master
copy of bfloat16 params) is held in pinned host memory between steps; the step moves it in
after its backward pass, right before the optimiser's update
(``alignax.trainers.engine.step.make_train_step``), and its outputs go back to host memory
(the step's ``out_shardings``, :func:`place_optimizer_state`): one round trip per step.

``device`` (the default): the weights stay in device memory, as without this module.

The CPU backend has the same memory kinds, so a CPU run takes the same code path (its
"host" and "device" are the same RAM: CPU shows the placement and the transfers in the
compiled program, not a saving).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

Where = Literal["device", "host"]
HOST_MEMORY = "pinned_host"


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Which memory holds the frozen models of a run.

    Fields:
      reference: the frozen reference policy (DPO family and KTO with ``dpo.reference:
        live``; GRPO and PPO with a KL to the reference): ``device`` | ``host`` (held in
        pinned host memory, moved to the device inside each program that runs it).
      reward_models: the reward models of online training (``rewards.reward_models``):
        ``device`` | ``host``, as for ``reference``.
      optimizer_state: the optimiser's state (moments, master weights): ``device`` |
        ``host`` (held in pinned host memory between steps; each step moves it in and
        writes the updated state back to host memory).
    """

    reference: Where = "device"
    reward_models: Where = "device"
    optimizer_state: Where = "device"


def _is_array(x) -> bool:
    return isinstance(x, jax.Array)


def to_host(tree: Any) -> Any:
    """``tree`` with every array moved to pinned host memory, its partition spec (and mesh)
    kept; other leaves unchanged. Outside a jit."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY)) if _is_array(x) else x,
                        tree)


def place(tree: Any, where: Where) -> Any:
    """``tree`` held where ``where`` says (``device``: ``tree`` itself)."""
    return to_host(tree) if where == "host" and tree is not None else tree


def place_optimizer_state(state: Any, shardings: Any, where: Where) -> tuple[Any, Any]:
    """``(state, shardings)`` of a train state (``opt_state`` field) with the optimiser state
    held where ``where`` says: for ``host``, its arrays moved to host memory and its
    shardings saying so (the step's ``out_shardings``: each step writes it back there)."""
    if where != "host":
        return state, shardings
    held = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings.opt_state)
    return state._replace(opt_state=to_host(state.opt_state)), shardings._replace(opt_state=held)


def to_device(tree: Any) -> Any:
    """Inside a jitted program: ``tree``'s arrays moved into device memory (same
    shardings); arrays already there are passed through. Call it right before the forward
    pass that reads them, so the device copy lives only as long as that pass needs it."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)
