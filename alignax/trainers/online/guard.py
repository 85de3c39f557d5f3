"""Alarms that act (``monitor:``, :class:`~alignax.trainers.config.MonitorSection`): after each
rollout step the :class:`Guard` reads the step's figures and its alarms
(:class:`~alignax.trainers.online.monitoring.Alarms` and the ones here), scores the gold set
when it is due (:class:`~alignax.trainers.online.gold.GoldSignal`), and does what each
raised alarm's ``action`` says:

- ``warn``: the warning and the event, nothing else;
- ``stop``: the engine loop saves a checkpoint and the run ends with
  :class:`AlarmStopError` (``alignax train`` exits with status :data:`EXIT_STATUS`, one line
  naming the alarm and its figures);
- ``rollback``: the state is restored from the checkpoint whose gold score was best (kept
  under ``<output_dir>/gold_best/``, apart from the rotating checkpoints so keep-N never
  removes it), the learning rate multiplied by ``monitor.rollback.lr_factor`` (the step is
  recompiled) and the KL coefficient by ``kl_factor``; the run goes on from the current
  step with new prompts. Past ``max_rollbacks`` a rollback is a stop.

``monitor.kl_budget``: the rollout's sequence KL to the reference (``kl/ref_seq``, nats)
above ``max`` stops the run or multiplies the KL coefficient by ``beta_factor``.

In a multi-process job every process decides alike: an alarm raised on any process's figures
is raised on all of them, with the first such process's reason
(:func:`~alignax.parallel.multihost.agreed_reasons`), so a stop ends every process with the
same line and a rollback restores the same checkpoint everywhere.

Every event is a line of ``<output_dir>/alarms.jsonl`` (``step``, ``alarm``, ``action``,
``reason``) and a metric (``guard/rollbacks``, ``guard/stop``, ``guard/kl_coef_raised``);
each gold point (``gold/score``, ``gold/proxy``: the mean proxy reward of the rollouts since
the previous point, ``gold/sqrt_kl``) is a metric too, so TensorBoard draws the Gao curve
live, and :meth:`Guard.finish` writes ``gold.json`` and ``gold.png`` (gold vs proxy vs
sqrt KL) at the end of the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from alignax import kl as kl_lib
from alignax import paths
from alignax.checkpoint import Checkpointer
from alignax.parallel.multihost import agreed_reasons, is_writer
from alignax.trainers import monitor_settings
from alignax.trainers.config import MonitorSection
from alignax.trainers.engine.loop import RunStoppedError
from alignax.trainers.engine.step import TrainState

log = logging.getLogger("alignax")

# The alarms in the order the guard acts on them (the first raised stop or rollback acts):
# those of the rollout's figures (alignax.trainers.online.monitoring), the rates, the gold's.
_FIGURE_ALARMS = ("kl_acceleration", "entropy_collapse", "length_drift", "no_signal")
_ORDER = (*_FIGURE_ALARMS, "clip_fraction", "nonfinite_rate", "gold_divergence")

EXIT_STATUS = 3
"""``alignax train``'s exit status when a monitor alarm (or the KL budget) stopped the run."""


class AlarmStopError(RunStoppedError):
    """A monitor alarm whose action is ``stop`` was raised (or a rollback past
    ``monitor.rollback.max_rollbacks``); the checkpoint of the step is saved first."""

    exit_code = EXIT_STATUS


@dataclasses.dataclass
class GoldPoint:
    """One gold evaluation: the step, the gold score, the mean proxy reward of the rollouts
    since the previous point (``None`` at the start), sqrt of the sequence KL to the
    reference (nats^0.5; ``None`` without a reference)."""

    step: int
    gold: float
    proxy: float | None
    sqrt_kl: float | None


class EventLog:
    """``<output_dir>/alarms.jsonl``: one JSON object per event, written whole at each event
    (events are rare; an object store cannot append) by process 0; a resumed run's events
    follow the earlier ones."""

    def __init__(self, path: str):
        self.path = path
        target = paths.as_path(path)
        self.lines = target.read_text(encoding="utf-8") if is_writer() and target.exists() else ""

    def write(self, step: int, alarm: str, action: str, reason: str, **figures: float) -> None:
        self.lines += json.dumps({"step": int(step), "alarm": alarm, "action": action, "reason": reason,
                                  **figures}) + "\n"
        if is_writer():
            paths.as_path(self.path).parent.mkdir(parents=True, exist_ok=True)
            paths.write_text(self.path, self.lines)


def scaled_kl_coef(state: TrainState, factor: float) -> TrainState:
    """``state`` with its KL controller's coefficient multiplied by ``factor``."""
    coef = state.extra["kl_coef"].coef
    return state._replace(extra={**state.extra, "kl_coef": kl_lib.KLControllerState(coef=coef * jnp.float32(factor))})


class BestGoldCheckpoint:
    """The train state whose gold score was best so far, in a directory of its own
    (``<output_dir>/gold_best``, one step kept): the rotating checkpoints' keep-N never
    removes it, and it survives a resume."""

    def __init__(self, directory: str):
        self.checkpointer = Checkpointer(directory, keep=1, async_save=False)

    def save(self, step: int, state: TrainState, gold: float) -> None:
        # the one kept state is the last saved: a run resumed from an earlier step saves again
        # at a step its abandoned run already saved, or below it (keep-1 would keep the other)
        self.checkpointer.delete_after(-1)
        self.checkpointer.save(step, state, {"gold": gold, "step": step}, force=True)
        self.checkpointer.wait()

    def step(self) -> int | None:
        """The step of the kept state (None: none saved)."""
        return self.checkpointer.latest_step()

    def restore(self, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """The kept state restored onto ``like``'s shardings, and its meta (``gold``, ``step``)."""
        return self.checkpointer.restore(like, self.checkpointer.latest_step())

    def close(self) -> None:
        self.checkpointer.close()


class Guard:
    """The monitor's actions over a run (see the module docstring).

    ``alarms``: the run's :class:`~alignax.trainers.online.monitoring.Alarms`; ``gold``: a
    :class:`~alignax.trainers.online.gold.GoldSignal` or ``None``; ``scale_learning_rate``:
    multiplies the policy's learning rate by a factor (the trainer recompiles its step);
    ``updates_per_rollout``: minibatches per epoch (the non-finite rate's denominator)."""

    def __init__(self, monitor: MonitorSection, output_dir: str, *, alarms, gold=None,
                 scale_learning_rate: Callable[[float], None] = lambda factor: None, updates_per_rollout: int = 1):
        self.monitor, self.output_dir, self.alarms, self.gold = monitor, output_dir, alarms, gold
        self.scale_learning_rate, self.updates_per_rollout = scale_learning_rate, updates_per_rollout
        self.actions = monitor_settings.actions(monitor)
        self.events = EventLog(os.path.join(output_dir, "alarms.jsonl"))
        self.best = BestGoldCheckpoint(os.path.join(output_dir, "gold_best")) if gold is not None else None
        self.points: list[GoldPoint] = []
        self.best_gold: float | None = None
        self.rollbacks = 0
        self.divergence_from = 0  # gold points before the last rollback are another policy's
        self.proxy_since: list[float] = []  # proxy rewards of the rollouts since the last gold point
        self.rates: dict[str, list[float]] = {"clip_fraction": [], "nonfinite_rate": []}
        self.lr_scale = 1.0

    # ------------------------------------------------------------------ saved with checkpoints
    def state(self) -> dict:
        return {"points": [dataclasses.asdict(p) for p in self.points], "best_gold": self.best_gold,
                "rollbacks": self.rollbacks, "divergence_from": self.divergence_from, "proxy_since": self.proxy_since, "rates": self.rates,
                "lr_scale": self.lr_scale}

    def set_state(self, saved: Mapping) -> None:
        self.points = [GoldPoint(**p) for p in saved.get("points", [])]
        self.best_gold, self.rollbacks = saved.get("best_gold"), int(saved.get("rollbacks", 0))
        self.divergence_from = int(saved.get("divergence_from", 0))
        self.proxy_since = list(saved.get("proxy_since", []))
        self.rates = {k: list(v) for k, v in saved.get("rates", self.rates).items()}
        self._forget_an_abandoned_best()
        if saved.get("lr_scale", 1.0) != 1.0:  # the recompiled step of the saved run
            self.lr_scale = 1.0
            self.retune_learning_rate(float(saved["lr_scale"]))

    def _forget_an_abandoned_best(self) -> None:
        """A resumed run whose gold-best folder holds another step than the best of its points
        (a run that saved a new best after the step it resumes from, then stopped): that state
        is not this run's, so it goes, and the next gold point saves the best again."""
        if self.best is None or self.best.step() is None:
            return
        best = [p.step for p in self.points if p.gold == self.best_gold]
        if not best or self.best.step() != best[0]:
            log.warning("the gold-best checkpoint of step %s is not the best gold point of the run resumed here "
                        "(%s); it is deleted and the next gold point saves the best", self.best.step(),
                        best[0] if best else "none")
            self.best.checkpointer.delete_after(-1)
            self.best_gold = None

    @property
    def touches_devices(self) -> bool:
        """Whether acting may run programs beyond the training mesh's: a gold point samples
        (on the sampler's mesh), a rollback restores a checkpoint (Orbax: collectives over
        every device)."""
        return self.gold is not None or "rollback" in self.actions.values()

    def retune_learning_rate(self, factor: float) -> None:
        self.lr_scale *= factor
        self.scale_learning_rate(factor)

    # ------------------------------------------------------------------ the run
    def begin(self, state: TrainState) -> dict[str, float]:
        """The gold point of the starting policy (a fresh run's first), kept as the best."""
        if self.gold is None:
            return {}
        return self._gold_point(0, state, kl=0.0)

    def __call__(self, step: int, state: TrainState, metrics: dict[str, float]) -> TrainState:
        """After rollout step ``step``: the actions of its alarms; the figures they add go into
        ``metrics`` (the step's, logged after this). Returns the state to go on from."""
        raised = {name: self.alarms.reasons.get(name, name) for name in _FIGURE_ALARMS
                  if metrics.get(f"alarm/{name}", 0.0) > 0}
        raised.update(self._rate_alarms(step, metrics))
        self.proxy_since.append(float(metrics["reward/total"]))
        if self.gold is not None and step % self.monitor.gold.every == 0:
            metrics.update(self._gold_point(step, state, kl=metrics.get("kl/ref_seq")))
            metrics["alarm/gold_divergence"] = 0.0
            raised.update(self._gold_divergence(step))
        # one decision for the job: an alarm raised on any process's figures acts on every process
        raised = agreed_reasons(raised, _ORDER)
        for name in raised:
            metrics[f"alarm/{name}"] = 1.0
        # the alarms act first: a stop saves the state before any raise of beta (so the checkpoint
        # and alarms.jsonl agree), and a rollback's restored state is the one the budget raises
        state = self._act(step, state, raised, metrics)
        return self._kl_budget(step, state, metrics)

    def _act(self, step: int, state: TrainState, raised: dict[str, str], metrics: dict[str, float]) -> TrainState:
        if "rollback" in self.actions.values():
            metrics["guard/rollbacks"] = float(self.rollbacks)
        for name, reason in raised.items():
            self.events.write(step, name, self.actions[name], reason)
        stops = [name for name in raised if self.actions[name] == "stop"]
        if stops:
            self._stop(step, stops[0], raised[stops[0]], metrics)
        rollbacks = [name for name in raised if self.actions[name] == "rollback"]
        if rollbacks:
            state = self._rollback(step, state, rollbacks[0], raised[rollbacks[0]], metrics)
        if "rollback" in self.actions.values():
            metrics["guard/rollbacks"] = float(self.rollbacks)
        return state

    def _stop(self, step: int, alarm: str, reason: str, metrics: dict[str, float]) -> None:
        metrics["guard/stop"] = 1.0
        self.events.write(step, alarm, "stop", f"stopping the run: {reason}")
        raise AlarmStopError(f"monitor.{alarm}.action=stop: {reason}; the run stops at step {step} "
                             f"(checkpoint saved; alarms.jsonl in {self.output_dir})")

    def _rollback(self, step: int, state: TrainState, alarm: str, reason: str,
                  metrics: dict[str, float]) -> TrainState:
        policy = self.monitor.rollback
        if self.rollbacks >= policy.max_rollbacks:
            self._stop(step, alarm, f"{reason} (monitor.rollback.max_rollbacks={policy.max_rollbacks} rollbacks "
                                    "already made)", metrics)
        if self.best.step() is None:  # a resumed run whose best was not its own, before its next gold point
            self._stop(step, alarm, f"{reason} (no gold-best checkpoint to roll back to since the resume)", metrics)
        restored, meta = self.best.restore(state)
        # the run's counters go on: the next rollout reads new prompts and the schedule moves forward
        restored = restored._replace(step=state.step, extra={**restored.extra, "rollouts": state.extra["rollouts"]},
                                     nonfinite_streak=state.nonfinite_streak, nonfinite_total=state.nonfinite_total)
        if policy.kl_factor != 1.0:
            restored = scaled_kl_coef(restored, policy.kl_factor)
        if policy.lr_factor != 1.0:
            self.retune_learning_rate(policy.lr_factor)
        self.rollbacks += 1
        self.alarms.clear()
        self.rates = {k: [] for k in self.rates}
        self.proxy_since = []
        self.divergence_from = len(self.points)
        log.warning("step %d: %s; rolled back to the gold-best checkpoint of step %d (gold %.4g), learning rate x%g, "
                    "KL coefficient x%g (%d of %d rollbacks)", step, reason, meta["step"], meta["gold"],
                    policy.lr_factor, policy.kl_factor, self.rollbacks, policy.max_rollbacks)
        self.events.write(step, alarm, "rollback", f"restored step {meta['step']} (gold {meta['gold']:.6g})",
                          restored_step=meta["step"], lr_factor=policy.lr_factor, kl_factor=policy.kl_factor)
        metrics["guard/rolled_back_to"] = float(meta["step"])
        return restored

    # ------------------------------------------------------------------ the alarms of this module
    def _rate_alarms(self, step: int, metrics: dict[str, float]) -> dict[str, str]:
        """``clip_fraction`` and ``nonfinite_rate``: their mean over the last ``window``
        rollouts above ``max``."""
        rates = {"clip_fraction": metrics.get("clipfrac_low", 0.0) + metrics.get("clipfrac_high", 0.0),
                 "nonfinite_rate": metrics.get("update_skipped", 0.0)
                 / max(metrics.get("epochs_run", 1.0) * self.updates_per_rollout, 1.0)}
        raised = {}
        for name, value in rates.items():
            alarm = getattr(self.monitor, name)
            history = self.rates[name] = (self.rates[name] + [float(value)])[-alarm.window:]
            mean = sum(history) / len(history)
            if alarm.max is None:
                continue
            metrics[f"alarm/{name}"] = 0.0  # armed: logged every rollout, 1.0 when raised (by __call__)
            if len(history) == alarm.window and mean > alarm.max:
                raised[name] = (f"step {step}: {name.replace('_', ' ')} {mean:.4g} over the last {alarm.window} "
                                f"rollouts is above monitor.{name}.max={alarm.max:g}")
                log.warning("%s", raised[name])
        return raised

    def _gold_divergence(self, step: int) -> dict[str, str]:
        """The proxy reward rose while the gold score fell over the last ``window`` gold points."""
        alarm, points = self.monitor.gold_divergence, self.points[self.divergence_from:]
        if len(points) <= alarm.window:
            return {}
        then, now = points[-1 - alarm.window], points[-1]
        # the start's point has no proxy before it: the first interval's stands for it
        then_proxy = then.proxy if then.proxy is not None else points[-alarm.window].proxy
        if then_proxy is None or now.proxy is None:
            return {}
        if then.gold - now.gold > alarm.min_gold_drop and now.proxy - then_proxy > alarm.min_proxy_rise:
            moved = "rose" if now.proxy > then_proxy else "went"  # min_proxy_rise < 0 lets a falling proxy in
            reason = (f"step {step}: the proxy reward {moved} {then_proxy:.4g} -> {now.proxy:.4g} while the gold score "
                      f"fell {then.gold:.4g} -> {now.gold:.4g} (steps {then.step} -> {now.step})")
            log.warning("%s", reason)
            return {"gold_divergence": reason}
        return {}

    def _kl_budget(self, step: int, state: TrainState, metrics: dict[str, float]) -> TrainState:
        budget, kl = self.monitor.kl_budget, metrics.get("kl/ref_seq")
        if budget.max is None:
            return state
        over = {} if kl is None or not kl > budget.max else {"kl_budget": (
            f"step {step}: KL to the reference {kl:.4g} nats is above monitor.kl_budget.max={budget.max:g}")}
        reason = agreed_reasons(over, ("kl_budget",)).get("kl_budget")  # every process acts, or none
        if reason is None:
            return state
        metrics["alarm/kl_budget"] = 1.0
        if budget.action == "stop":
            self._stop(step, "kl_budget", reason, metrics)
        self.events.write(step, "kl_budget", "raise_beta", f"{reason}; KL coefficient x{budget.beta_factor:g}")
        log.warning("%s; KL coefficient x%g", reason, budget.beta_factor)
        metrics["guard/kl_coef_raised"] = 1.0
        return scaled_kl_coef(state, budget.beta_factor)

    # ------------------------------------------------------------------ the gold signal
    def _gold_point(self, step: int, state: TrainState, *, kl: float | None) -> dict[str, float]:
        figures = self.gold.score(state.params)
        proxy = sum(self.proxy_since) / len(self.proxy_since) if self.proxy_since else None
        point = GoldPoint(step=step, gold=figures["gold/score"], proxy=proxy,
                          sqrt_kl=None if kl is None else math.sqrt(max(kl, 0.0)))
        self.points.append(point)
        self.proxy_since = []
        if proxy is not None:
            figures["gold/proxy"] = proxy
        if point.sqrt_kl is not None:
            figures["gold/sqrt_kl"] = point.sqrt_kl
        if self.best_gold is None or point.gold > self.best_gold:
            self.best_gold = point.gold
            self.best.save(step, state, point.gold)
        figures["gold/best"] = self.best_gold
        return figures

    def finish(self) -> None:
        """``gold.json`` (the points) and ``gold.png`` (with ``monitor.plot``) in the run directory."""
        if self.best is not None:
            self.best.close()
        if not self.points or not is_writer():
            return
        paths.write_text(os.path.join(self.output_dir, "gold.json"),
                         json.dumps({"points": [dataclasses.asdict(p) for p in self.points],
                                     "rollbacks": self.rollbacks}, indent=1))
        if self.monitor.plot:
            plot_gold(self.points, os.path.join(self.output_dir, "gold.png"))


def build_guard(config, trainer) -> Guard:
    """The :class:`Guard` of an :class:`~alignax.trainers.online.trainer.OnlineTrainer`'s run
    (its alarms, actors, data and learner), with the gold signal when ``monitor.gold.prompts``
    is set. Build it once the run directory is claimed: the gold-best checkpoint lives there."""
    from alignax.trainers.online.gold import GoldSignal

    gold = None if config.monitor.gold.prompts is None else GoldSignal(config, trainer.actors, trainer.data)
    return Guard(config.monitor, config.output_dir, alarms=trainer.alarms, gold=gold,
                 scale_learning_rate=trainer.learner.scale_learning_rate,
                 updates_per_rollout=trainer.algorithm.minibatches)


def plot_gold(points: list[GoldPoint], path: str, *, title: str = "gold vs proxy vs sqrt KL") -> str:
    """The gold score (top; its own scale: gold and proxy rewards need not share units), and
    the proxy reward with sqrt KL to the reference on a second axis (bottom), against the
    rollout step, as a PNG at ``path`` (matplotlib, Agg backend); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (gold_axis, proxy_axis) = plt.subplots(2, 1, sharex=True, figsize=(6, 5), dpi=110)
    gold_axis.plot([p.step for p in points], [p.gold for p in points], "o-", label="gold")
    gold_axis.set_ylabel("gold reward")
    gold_axis.set_title(title)
    with_proxy = [p for p in points if p.proxy is not None]
    proxy_axis.plot([p.step for p in with_proxy], [p.proxy for p in with_proxy], "s--", color="tab:orange",
                    label="proxy")
    proxy_axis.set_ylabel("proxy reward")
    proxy_axis.set_xlabel("rollout step")
    with_kl = [p for p in points if p.sqrt_kl is not None]
    if with_kl:
        kl_axis = proxy_axis.twinx()
        kl_axis.plot([p.step for p in with_kl], [p.sqrt_kl for p in with_kl], "^:", color="grey", label="sqrt KL")
        kl_axis.set_ylabel("sqrt KL (nats^0.5)")
        kl_axis.legend(loc="lower right")
    proxy_axis.legend(loc="upper left")
    fig.tight_layout()
    with paths.as_path(path).open("wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path


__all__ = ["AlarmStopError", "BestGoldCheckpoint", "build_guard", "EXIT_STATUS", "EventLog", "GoldPoint", "Guard", "plot_gold",
           "scaled_kl_coef"]
