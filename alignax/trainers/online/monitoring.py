"""Alarms for online RL: the failure patterns worth a warning while a run is still cheap.

Each rollout step's figures go in; alarms come out as ``alarm/<name>`` metrics (1.0 when
raised) and a logged warning naming the figures behind it:

- ``kl_acceleration``: KL to the reference grows faster and faster — over the last
  ``window`` steps every increment exceeded the one before and KL is above ``kl_floor``
  (the runaway that precedes reward hacking or collapse);
- ``entropy_collapse``: policy entropy fell below ``entropy_fraction`` of its first value
  (the policy has stopped exploring);
- ``length_drift``: mean response length moved by more than ``length_change`` (relative)
  over the window while the raw task reward did not rise (length is being exploited,
  not the task learned).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping

log = logging.getLogger("alignax")


@dataclasses.dataclass
class AlarmSettings:
    window: int = 5
    kl_floor: float = 0.01
    entropy_fraction: float = 0.2
    length_change: float = 0.5


class Alarms:
    """Keeps a short history of figures; ``update`` returns the ``alarm/*`` metrics."""

    def __init__(self, settings: AlarmSettings | None = None):
        self.settings = settings or AlarmSettings()
        n = self.settings.window + 1
        self.kl = collections.deque(maxlen=n)
        self.length = collections.deque(maxlen=n)
        self.reward = collections.deque(maxlen=n)
        self.first_entropy: float | None = None

    def state(self) -> dict:
        """JSON-able history, saved with checkpoints so a resumed run alarms the same."""
        return {"kl": list(self.kl), "length": list(self.length), "reward": list(self.reward),
                "first_entropy": self.first_entropy}

    def set_state(self, state: Mapping) -> None:
        self.kl.extend(state.get("kl", []))
        self.length.extend(state.get("length", []))
        self.reward.extend(state.get("reward", []))
        self.first_entropy = state.get("first_entropy")

    def update(self, step: int, *, kl: float, entropy: float | None, length: float, reward: float) -> dict[str, float]:
        s = self.settings
        self.kl.append(kl)
        self.length.append(length)
        self.reward.append(reward)
        raised = {"kl_acceleration": False, "entropy_collapse": False, "length_drift": False}
        if len(self.kl) == self.kl.maxlen:
            steps = [b - a for a, b in zip(self.kl, list(self.kl)[1:])]
            accelerating = all(d2 > d1 > 0 for d1, d2 in zip(steps, steps[1:]))
            if accelerating and kl > s.kl_floor:
                raised["kl_acceleration"] = True
                log.warning("step %d: KL to the reference is accelerating: %s", step,
                            ", ".join(f"{v:.4g}" for v in self.kl))
        if entropy is not None:
            if self.first_entropy is None:
                self.first_entropy = entropy
            elif self.first_entropy > 0 and entropy < s.entropy_fraction * self.first_entropy:
                raised["entropy_collapse"] = True
                log.warning("step %d: entropy collapsed to %.4g (%.0f%% of its first value %.4g)", step, entropy,
                            100 * entropy / self.first_entropy, self.first_entropy)
        if len(self.length) == self.length.maxlen:
            start_len, start_reward = self.length[0], self.reward[0]
            change = abs(length - start_len) / max(start_len, 1.0)
            if change > s.length_change and reward <= start_reward:
                raised["length_drift"] = True
                log.warning("step %d: mean response length moved %.4g -> %.4g while the task reward did not rise "
                            "(%.4g -> %.4g)", step, start_len, length, start_reward, reward)
        return {f"alarm/{k}": float(v) for k, v in raised.items()}
