"""What online RL watches: each rollout's figures (:func:`rollout_figures`) and alarms for
the failure patterns worth a warning while a run is still cheap.

Each rollout step's figures go in; alarms come out as ``alarm/<name>`` metrics (1.0 when
raised) and a logged warning naming the figures behind it:

- ``kl_acceleration``: KL to the reference grows faster and faster — over the last
  ``window`` steps every increment exceeded the one before and KL is above ``kl_floor``
  (the runaway that precedes reward hacking or collapse); never raised in a run without a
  reference model (``update(kl=None)``: there is no KL to watch);
- ``entropy_collapse``: policy entropy fell below ``entropy_fraction`` of its first value
  (the policy has stopped exploring);
- ``length_drift``: mean response length moved by more than ``length_change`` (relative)
  over the window while the raw task reward did not rise (length is being exploited,
  not the task learned);
- ``no_signal``: every update of the rollout had an exactly zero gradient (tied rewards,
  zero advantages, nothing for a critic to learn). The engine's stall watch counts a zero
  loss with a zero gradient as "no signal", not a stall, because one such GRPO batch is
  normal; a run where it lasts ``train.max_stalled_streak`` rollouts never trains (a
  recipe whose rewards are all 0), and stops with :class:`StalledRunError`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping

import jax
import numpy as np

from alignax import kl as kl_lib
from alignax.envs.rollout import trajectory_figures
from alignax.parallel.multihost import allgather_rows, host_global
from alignax.sampling.scored import Groups
from alignax.trainers.config import MonitorSection
from alignax.trainers.engine.loop import StalledRunError
from alignax.trainers.online.collect import RolloutBatch
from alignax.trainers.online.grpo import group_reward_std
from alignax.trainers.online.update import UpdateResult

log = logging.getLogger("alignax")


@dataclasses.dataclass
class AlarmSettings:
    """The thresholds (``monitor.*`` of the run config, :meth:`from_monitor`); ``window``:
    KL acceleration's rollouts, ``length_window`` length drift's (``None``: ``window``);
    ``no_signal_streak``: zero-gradient rollouts in a row that raise ``no_signal``."""

    window: int = 5
    kl_floor: float = 0.01
    entropy_fraction: float = 0.2
    length_change: float = 0.5
    length_window: int | None = None
    no_signal_streak: int = 1

    @classmethod
    def from_monitor(cls, monitor: MonitorSection) -> AlarmSettings:
        return cls(window=monitor.kl_acceleration.window, kl_floor=monitor.kl_acceleration.kl_floor,
                   entropy_fraction=monitor.entropy_collapse.fraction, length_change=monitor.length_drift.change,
                   length_window=monitor.length_drift.window, no_signal_streak=monitor.no_signal.streak)


class Alarms:
    """Keeps a short history of figures; ``update`` returns the ``alarm/*`` metrics, and
    :attr:`reasons` says in one line why each alarm of the last update was raised."""

    def __init__(self, settings: AlarmSettings | None = None, *, max_stalled_streak: int = 0):
        self.settings = settings or AlarmSettings()
        n = self.settings.window + 1
        n_length = (self.settings.length_window or self.settings.window) + 1
        self.kl = collections.deque(maxlen=n)
        self.length = collections.deque(maxlen=n_length)
        self.reward = collections.deque(maxlen=n_length)
        self.reasons: dict[str, str] = {}
        self.first_entropy: float | None = None
        self.max_stalled_streak = max_stalled_streak  # 0: never stop the run
        self.no_signal = 0  # rollouts in a row whose every update had a zero gradient

    def state(self) -> dict:
        """JSON-able history, saved with checkpoints so a resumed run alarms the same."""
        return {"kl": list(self.kl), "length": list(self.length), "reward": list(self.reward),
                "first_entropy": self.first_entropy, "no_signal": self.no_signal}

    def clear(self) -> None:
        """Forget the recent history (after a rollback the restored policy starts a new one);
        the first entropy stays the run's baseline."""
        for history in (self.kl, self.length, self.reward):
            history.clear()
        self.no_signal = 0

    def set_state(self, state: Mapping) -> None:
        self.kl.extend(state.get("kl", []))
        self.length.extend(state.get("length", []))
        self.reward.extend(state.get("reward", []))
        self.first_entropy = state.get("first_entropy")
        self.no_signal = int(state.get("no_signal", 0))

    def update(self, step: int, *, kl: float | None, entropy: float | None, length: float,
               reward: float, grad_norm: float | None = None) -> dict[str, float]:
        """``kl``: the sequence KL to the reference, ``None`` without a reference (the KL
        history is then left as it is and ``kl_acceleration`` stays down); ``grad_norm``:
        the largest gradient norm of the rollout's updates (``None``: not watched)."""
        s = self.settings
        self.reasons = {}
        self.length.append(length)
        self.reward.append(reward)
        raised = {"kl_acceleration": False, "entropy_collapse": False, "length_drift": False,
                  "no_signal": self._no_signal(step, grad_norm, reward)}
        if kl is not None:
            self.kl.append(kl)
            if len(self.kl) == self.kl.maxlen:
                steps = [b - a for a, b in zip(self.kl, list(self.kl)[1:])]
                accelerating = all(d2 > d1 > 0 for d1, d2 in zip(steps, steps[1:]))
                if accelerating and kl > s.kl_floor:
                    raised["kl_acceleration"] = True
                    self._say("kl_acceleration", "step %d: KL to the reference is accelerating: %s", step,
                              ", ".join(f"{v:.4g}" for v in self.kl))
        if entropy is not None:
            if self.first_entropy is None:
                self.first_entropy = entropy
            elif self.first_entropy > 0 and entropy < s.entropy_fraction * self.first_entropy:
                raised["entropy_collapse"] = True
                self._say("entropy_collapse", "step %d: entropy collapsed to %.4g (%.0f%% of its first value %.4g)", step, entropy,
                            100 * entropy / self.first_entropy, self.first_entropy)
        if len(self.length) == self.length.maxlen:
            start_len, start_reward = self.length[0], self.reward[0]
            change = abs(length - start_len) / max(start_len, 1.0)
            if change > s.length_change and reward <= start_reward:
                raised["length_drift"] = True
                self._say("length_drift", "step %d: mean response length moved %.4g -> %.4g while the task reward did not rise "
                            "(%.4g -> %.4g)", step, start_len, length, start_reward, reward)
        return {f"alarm/{k}": float(v) for k, v in raised.items()}

    def _no_signal(self, step: int, grad_norm: float | None, reward: float) -> bool:
        """Counts rollouts in a row with a zero gradient; raises :class:`StalledRunError`
        when they reach ``max_stalled_streak``."""
        if grad_norm is None:
            return False
        self.no_signal = self.no_signal + 1 if grad_norm == 0.0 else 0
        if not self.no_signal:
            return False
        self._say("no_signal", "step %d: no learning signal: every update had a zero gradient (%d rollouts in a "
                  "row)", step, self.no_signal)
        if self.max_stalled_streak and self.no_signal >= self.max_stalled_streak:
            raise StalledRunError(
                f"{self.no_signal} rollouts in a row had an exactly zero gradient (step {step}, mean reward "
                f"{reward:.6g}): the rewards give no learning signal (every sample's reward the same, e.g. all 0), "
                f"so the run never trains; stopping (train.max_stalled_streak={self.max_stalled_streak}). Give "
                "the rewards (rewards.*) a component that varies between samples.")
        return self.no_signal >= self.settings.no_signal_streak

    def _say(self, alarm: str, message: str, *args) -> None:
        """Log ``alarm``'s warning and keep its line as the reason."""
        self.reasons[alarm] = message % args
        log.warning("%s", self.reasons[alarm])


def rollout_figures(groups: Groups, rewards, seq_kl, old_logps, ref_logps, recomputed, sampler_logps, response_mask,
                    entropy, advantages, *, group_size: int) -> dict[str, float]:
    """The monitoring list of one rollout (host floats): rewards and their components,
    response lengths, stop/truncation rates, KL to the reference (sequence, k1, k3),
    entropy, sampler/trainer log-prob mismatch, advantages, zero-variance groups.

    ``rewards [R]``: what the advantages saw (after a KL placed in the reward);
    per-token arrays ``[R, N]`` are averaged over ``response_mask``. A run without a
    reference model passes ``seq_kl`` and ``ref_logps`` as ``None`` and gets no ``kl/ref_*``
    figures (a KL against nothing is not zero, it is not there); a loss that reads no
    advantage passes ``advantages`` as ``None`` and gets no ``advantages/*`` figures.
    """
    if (seq_kl is None) != (ref_logps is None):
        raise ValueError("seq_kl and ref_logps go together: both None (no reference model) or both arrays")
    mask = np.asarray(response_mask)
    lengths = mask.sum(axis=1)
    n_tokens = max(mask.sum(), 1.0)

    def masked_mean(x) -> float:
        return float(np.sum(np.where(mask > 0, np.asarray(x), 0.0)) / n_tokens)

    diff = np.asarray(recomputed) - np.asarray(sampler_logps)
    figures = {
        "reward/total": float(np.mean(groups.rewards)),
        "reward/std": float(np.std(groups.rewards)),
        "reward/after_kl": float(np.mean(rewards)),
        "response/length_mean": float(lengths.mean()),
        "response/length_min": float(lengths.min()),
        "response/length_max": float(lengths.max()),
        "response/stop_rate": float(np.mean(groups.stopped)),
        "response/truncation_rate": float(np.mean(~groups.stopped)),
        "entropy": masked_mean(entropy),
        "mismatch/sampler_trainer_abs": masked_mean(np.abs(diff)),
        "mismatch/sampler_trainer_max": float(np.max(np.where(mask > 0, np.abs(diff), 0.0))),
        "mismatch/sampler_trainer_k3": masked_mean(kl_lib.kl_estimate(sampler_logps, recomputed, kind="k3")),
    }
    if advantages is not None:
        figures["advantages/mean"] = masked_mean(advantages)
        figures["advantages/abs_mean"] = masked_mean(np.abs(np.asarray(advantages)))
    if ref_logps is not None:
        figures["kl/ref_seq"] = float(np.mean(seq_kl))
        figures["kl/ref_k1"] = masked_mean(np.asarray(old_logps) - np.asarray(ref_logps))
        figures["kl/ref_k3"] = masked_mean(kl_lib.kl_estimate(old_logps, ref_logps, kind="k3"))
    for name, values in groups.components.items():
        figures[f"reward/{name}"] = float(np.mean(values))
    if group_size > 1:
        figures["groups/zero_variance_fraction"] = float(np.mean(group_reward_std(groups.rewards, group_size) == 0))
    return figures


def step_figures(batch: RolloutBatch, result: UpdateResult, *, mesh: jax.sharding.Mesh,
                 group_size: int, with_advantages: bool = True) -> dict[str, float]:
    """One rollout step's figures (host floats, the same on every process): the batch's own
    (generation, refills, step rewards), :func:`rollout_figures` over every process's rows,
    a multi-turn run's trajectory figures, the updates' metrics (means; ``grad_norm_max``,
    ``update_skipped`` summed, the first minibatch's ratios), ``epochs_run``, the next
    ``kl_coef`` and the learner's timing. ``with_advantages=False`` (a loss on whole
    distributions that reads no advantage, e.g. exact on-policy distillation, whose rollout
    carries zeros) neither gathers the advantages nor logs ``advantages/*`` (a constant 0)."""
    groups, rewards = gathered_rows(batch.groups, batch.rewards)
    device_arrays = host_global((result.old_logps, result.ref_logps, result.recomputed,
                                 batch.rollout.sampler_logps, batch.response_mask, result.entropy,
                                 batch.rollout.advantages if with_advantages else None), mesh)
    figures = dict(batch.figures)
    figures.update(rollout_figures(groups, rewards, result.seq_kl, *device_arrays, group_size=group_size))
    if groups.trajectory:
        figures.update(trajectory_figures(groups, figures["perf/generation_s"]))
    updates = result.metrics
    for key in updates[0]:
        figures[key] = float(np.mean([m[key] for m in updates]))
    figures["grad_norm_max"] = float(np.max([m["grad_norm"] for m in updates]))
    figures["update_skipped"] = float(np.sum([m["update_skipped"] for m in updates]))
    for key in ("ratio_mean", "ratio_min", "ratio_max", "approx_kl"):
        if key in updates[0]:
            figures[f"first_minibatch/{key}"] = updates[0][key]
    figures["epochs_run"] = float(result.epochs_run)
    figures["kl_coef"] = float(jax.device_get(result.kl_coef.coef))
    train_tokens = float(jax.device_get(jax.numpy.sum(batch.rollout.loss_mask))) * result.epochs_run
    figures["perf/training_s"] = result.seconds
    figures["perf/training_tokens_per_s"] = train_tokens / max(result.seconds, 1e-9)
    return figures


def gathered_rows(groups: Groups, rewards: np.ndarray) -> tuple[Groups, np.ndarray]:
    """Every process's rows of what the figures read (this process's, with one process):
    the rewards ``[R]`` the advantages saw, and of ``groups`` the rewards, stop flags and
    reward components, and a multi-turn run's per-row trajectory counts and masks."""
    if jax.process_count() == 1:
        return groups, rewards
    trajectory = {}
    if groups.trajectory:
        trajectory = dict(response_mask=allgather_rows(groups.response_mask),
                          action_mask=allgather_rows(groups.actions()),
                          trajectory={k: allgather_rows(v) for k, v in groups.trajectory.items()})
    groups = dataclasses.replace(groups, rewards=allgather_rows(groups.rewards), stopped=allgather_rows(groups.stopped),
                                 components={k: allgather_rows(v) for k, v in groups.components.items()},
                                 **trajectory)
    return groups, allgather_rows(rewards)
