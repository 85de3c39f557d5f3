"""The ``monitor:`` section's value checks (:class:`~alignax.trainers.config.MonitorSection`):
ranges, and the pairs of values that must agree. :mod:`alignax.trainers.validation` runs
:func:`problem` on every online config; which keys an algorithm reads is its key table's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from alignax.models.registry import model_identity
from alignax.rewards.composite import RewardConfig, scorers
from alignax.trainers.config import MonitorSection, TrainConfig

ALARMS = ("kl_acceleration", "entropy_collapse", "length_drift", "no_signal", "gold_divergence", "clip_fraction",
          "nonfinite_rate")
"""The alarms of :class:`MonitorSection`, each with an ``action``."""

_AT_LEAST_ONE = ("kl_acceleration.window", "length_drift.window", "no_signal.streak", "gold_divergence.window",
                 "clip_fraction.window", "nonfinite_rate.window", "gold.every", "gold.max_prompts")


def _value(monitor: MonitorSection, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(monitor, section), key)


def _ranges(m: MonitorSection) -> str | None:
    for dotted in _AT_LEAST_ONE:
        if _value(m, dotted) < 1:
            return f"monitor.{dotted} must be >= 1; got {_value(m, dotted)}"
    if not 0 <= m.entropy_collapse.fraction < 1:
        return f"monitor.entropy_collapse.fraction must be in [0, 1); got {m.entropy_collapse.fraction}"
    for dotted in ("rollback.lr_factor", "rollback.kl_factor", "kl_budget.beta_factor"):
        if not _value(m, dotted) > 0:
            return f"monitor.{dotted} must be > 0 (a factor); got {_value(m, dotted)}"
    if m.rollback.max_rollbacks < 0:
        return f"monitor.rollback.max_rollbacks must be >= 0; got {m.rollback.max_rollbacks}"
    if m.kl_budget.max is not None and not m.kl_budget.max > 0:
        return f"monitor.kl_budget.max must be > 0 nats (null: no budget); got {m.kl_budget.max}"
    return None


def _shared_scorer(gold: RewardConfig, train: RewardConfig | None,
                   trained_models: Sequence[tuple[str, str]]) -> str | None:
    """A scorer of the gold reward that the training reward weighs too, under whatever name
    (:func:`alignax.rewards.composite.scorers`; ``train``: None when the updates do not follow
    ``rewards:``; ``trained_models``: ``(key, folder)`` of the algorithm's own scoring models),
    in words naming both keys; or None."""
    trained = {identity: f"rewards.{key}" for key, identity in scorers(train)} if train is not None else {}
    trained.update({f"the model {model_identity(folder)}": key for key, folder in trained_models})
    for key, identity in scorers(gold):
        if identity in trained:
            return (f"monitor.gold.rewards.{key} is {identity}, which the training reward weighs too "
                    f"({trained[identity]}): a gold signal must be scored by something the policy is not "
                    "trained on; give monitor.gold.rewards another verifier, judge, reward model or function (a "
                    "scorer's weight 0 leaves it out)")
    return None


def actions(m: MonitorSection) -> dict[str, str]:
    """Alarm name -> its action."""
    return {name: getattr(m, name).action for name in ALARMS}


def problem(config: TrainConfig, section: str, trained_models: Sequence[tuple[str, str]] = (),
            trains_on_rewards: bool = True) -> str | None:
    """The first problem of ``config.monitor`` in words naming its keys (``section``: the
    online algorithm's own section, which holds ``kl_coef``; ``trained_models``: ``(key,
    folder)`` of the scoring models the algorithm trains with beyond ``rewards:``;
    ``trains_on_rewards``: whether its updates follow ``rewards:``, which the gold scorer must
    then differ from), or None."""
    m = config.monitor
    found = _ranges(m)
    if found:
        return found
    rollbacks = [name for name, action in actions(m).items() if action == "rollback"]
    if rollbacks and m.gold.prompts is None:
        return (f"monitor.{rollbacks[0]}.action=rollback restores the checkpoint whose gold score was best; set "
                "monitor.gold.prompts (a held-out prompt set) or use action warn or stop")
    if rollbacks and config.rollout.async_.max_staleness > 0:
        return (f"monitor.{rollbacks[0]}.action=rollback with rollout.async.max_staleness="
                f"{config.rollout.async_.max_staleness}: batches in flight were sampled before the rollback; use "
                "action stop, or max_staleness 0")
    if m.gold.prompts is not None and trains_on_rewards and m.gold.rewards == config.rewards:
        return ("monitor.gold.rewards is the training reward (rewards): a gold signal must be scored by something "
                "the policy is not trained on; set monitor.gold.rewards to another verifier, judge, reward model "
                "or function")
    training_rewards = config.rewards if trains_on_rewards else None
    shared = (_shared_scorer(m.gold.rewards, training_rewards, trained_models)
              if m.gold.prompts is not None else None)
    if shared:
        return shared
    if m.gold.prompts is not None and config.env.name is not None:
        return (f"monitor.gold.prompts with env.name={config.env.name}: the gold signal scores single-turn "
                "completions; remove monitor.gold or the environment")
    for name in ("clip_fraction", "nonfinite_rate"):
        if getattr(m, name).max is not None and getattr(m, name).max < 0:
            return f"monitor.{name}.max must be >= 0 (a rate; null: off); got {getattr(m, name).max}"
    if m.gold.prompts is not None and m.gold.prompts.format != "prompt":
        return f"monitor.gold.prompts.format={m.gold.prompts.format}: the gold set is a prompt set (format prompt)"
    moves_beta = m.kl_budget.action == "raise_beta" and m.kl_budget.max is not None
    moves_beta = moves_beta or (rollbacks and m.rollback.kl_factor != 1.0)
    # a section without a KL coefficient (on-policy distillation's) trains with none: 0
    kl_coef = getattr(getattr(config, section, None), "kl_coef", 0.0)
    if moves_beta and kl_coef == 0 and not getattr(getattr(config, section), "adaptive_kl", False):
        where = f"{section}.kl_coef is 0" if hasattr(getattr(config, section, None), "kl_coef") else \
            f"algorithm {config.algorithm} trains with no KL coefficient"
        fix = f"set {section}.kl_coef > 0" if "kl_coef is 0" in where else "use the lr_factor alone"
        return (f"monitor raises the KL coefficient (kl_budget.action=raise_beta or rollback.kl_factor) but "
                f"{where}: a factor times 0 stays 0; {fix}")
    return None


def with_actions(monitor: MonitorSection, **alarm_actions: str) -> MonitorSection:
    """``monitor`` with the named alarms' actions replaced (a study's two arms)."""
    return dataclasses.replace(monitor, **{name: dataclasses.replace(getattr(monitor, name), action=action)
                                           for name, action in alarm_actions.items()})
