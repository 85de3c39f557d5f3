"""The adaptive entropy coefficient (Skywork-OR1: He et al. 2025, "Skywork Open Reasoner 1
Technical Report", arXiv 2505.22312, Section 3.2.3 "adaptive entropy control"; TRL 1.16's
``use_adaptive_entropy``).

With ``c_k`` the coefficient and ``H_k`` the mean entropy of rollout ``k``'s response tokens
(nats, under the policy that the rollout's update started from):

    c_{k+1} = min(c_k + delta, c_max)   if H_k < H_target
              max(c_k - delta, 0)       otherwise
    loss_k  = ... - a_k * agg(H),   a_k = c_k if H_{k-1} <= H_target else 0

so the bonus turns on only once the entropy has fallen to the target, and its weight grows
while the entropy stays below it. Skywork-OR1 and TRL step ``c`` once per optimizer step;
here it steps once per rollout (the cadence of the KL controller), the same when a rollout
has one update. The state, ``(c_k, H_{k-1})``, lives in the train state (``extra``) and so is
checkpointed and restored with it; before the first rollout ``H_{-1} = H_target`` (the bonus
is on with ``grpo.entropy_coef``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class EntropyCoefState(NamedTuple):
    """``coef``: ``c_k``; ``entropy``: ``H_{k-1}``, the last rollout's mean entropy (float32 scalars)."""

    coef: Array
    entropy: Array


@dataclasses.dataclass(frozen=True)
class AdaptiveEntropyController:
    """``init_coef``: ``c_0`` (``grpo.entropy_coef``); ``target``: ``H_target`` (nats per
    token, ``grpo.target_entropy``); ``delta`` / ``max_coef``: the step and the ceiling
    (``grpo.entropy_coef_delta``, ``grpo.entropy_coef_max``; TRL's 0.005 and 1.0)."""

    init_coef: float
    target: float
    delta: float = 0.005
    max_coef: float = 1.0

    def __post_init__(self):
        if self.target < 0 or self.delta <= 0 or not 0 <= self.init_coef <= self.max_coef:
            raise ValueError(f"adaptive entropy needs grpo.target_entropy >= 0, grpo.entropy_coef_delta > 0 and "
                             f"0 <= grpo.entropy_coef <= grpo.entropy_coef_max; got {self.target}, {self.delta}, "
                             f"{self.init_coef}, {self.max_coef}")

    def init(self) -> EntropyCoefState:
        return EntropyCoefState(coef=jnp.asarray(self.init_coef, jnp.float32),
                                entropy=jnp.asarray(self.target, jnp.float32))

    def applied(self, state: EntropyCoefState) -> Array:
        """``a_k``: the coefficient the loss uses this rollout."""
        return jnp.where(state.entropy <= self.target, state.coef, 0.0)

    def update(self, state: EntropyCoefState, entropy: Array) -> EntropyCoefState:
        """The state after a rollout whose response tokens had mean entropy ``entropy``."""
        entropy = jnp.asarray(entropy, jnp.float32)
        step = jnp.where(entropy < self.target, self.delta, -self.delta)
        return EntropyCoefState(coef=jnp.clip(state.coef + step, 0.0, self.max_coef), entropy=entropy)
