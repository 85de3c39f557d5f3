"""Cross-field validation of a run config, before any model is read: the run config's key
table and constraints, written in the condition language of :mod:`alignax.config`; what
belongs to one algorithm (its sections' rows, its constraints, its data formats, its
frozen models) comes from its entry in :mod:`alignax.trainers.algorithms`.

``alignax.trainers.api.load_config`` calls :func:`validate` on every ``TrainConfig`` it
builds. Two tables say what a valid config is:

- :data:`KEY_RULES`: every key of the schema, and the condition under which the run's
  code reads it (``grpo.dual_clip_c``: ``algorithm=grpo`` and ``grpo.policy_loss=ppo``).
  A key *set* (its value differs from its dataclass default) where its condition fails is
  an error: the run would silently ignore it. Keys left at their defaults are never an
  error, so a recipe only names what it uses. Keys of the shared sections (model, optim,
  train, checkpoint, logging, mesh, data) are read by every algorithm, save the rows that
  say otherwise; turning a shared feature off (``checkpoint.enabled: false``,
  ``logging.console: false``, ``data.eval_fraction: 0``) leaves its keys valid, so one
  override switches a recipe's feature off. A key matched by several rows (a section
  row, then a row of its own) needs all of them to hold. The table covers every key
  (``tests/test_config_schema.py`` checks that, and sweeps the schema against each
  algorithm's instrumented run).
- :data:`CONSTRAINTS` (then the algorithm's own): values that must agree with each other
  (``data.format`` with the algorithm, batch sizes that split into minibatches and
  micro-batches, ...), values out of range (``checkpoint.keep``, ``mesh.shape``,
  ``rewards.task``), and a cheap look at the local files a run would read later: a
  ``model.name`` folder lacking config.json, weights or tokenizer files
  (:func:`alignax.models.registry.model_folder_problem`); a data file that is empty, or
  whose first record has the fields of another format than the section's ``format``
  (:func:`alignax.data.checks.data_file_problem`). Generator specs, folders and paths that
  do not exist are left to the data pipeline and the model loader, which name them.

Every error is a :class:`~alignax.config.ConfigError` naming the dotted key(s), the
algorithm, the setting that makes the key unusable, and what would be right.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

from alignax.best_of_n import BestOfNConfig
from alignax.config import (ALWAYS, NEVER, Above, All, AnyOf, Check, Cond, ConfigError, Given, Is, IsNot,
                            Named, NonZero, Rule, Unusable, keys_of, rule, set_keys, show)
from alignax.config import schema_keys as config_schema_keys
from alignax.config import unusable_keys as _unusable_keys
from alignax.config import get as config_get
from alignax.data import checks as data_checks
from alignax.losses.objectives import OBJECTIVES
from alignax.models import registry
from alignax.parallel.placement import SUBMESH_ROLES
from alignax.parallel.sharding import MESH_AXES
from alignax.rewards.composite import RewardConfig
from alignax.rewards.verifiers import check_task
from alignax.trainers import monitor_settings
from alignax.trainers.algorithms import ENTRIES, algorithm, except_where, named, where
from alignax.trainers.config import RolloutSection, TrainConfig


def _names(test) -> str:
    names = [a.name for a in ENTRIES if test(a)]
    return ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]


# ---------------------------------------------------------------------------- conditions from the map
ONLINE = where(lambda a: a.family == "online")
OFFLINE = where(lambda a: a.family == "offline")
EVAL_PROMPTS = Given("evaluation.prompts")
# the policy objectives without a ratio of their own (REINFORCE-style): bypass mode weighs them explicitly
_RATIO_FREE = tuple(name for name, entry in OBJECTIVES.items() if not entry.ratio)
NO_ENV = Named("no environment (env.name null)", Is("env.name", None))
# alignax.evaluation: a run that samples in training evaluates by generation (on its eval
# split, or on evaluation.prompts); an offline policy only on evaluation.prompts (its data
# are not prompts), and a reward model never (it does not generate).
_OFFLINE_POLICY = lambda a: a.family == "offline" and a.head == "lm"  # noqa: E731
OFFLINE_EVAL = All(where(_OFFLINE_POLICY), EVAL_PROMPTS)
GENERATES = where(lambda a: a.generates)
GENERATION = Named(f"online training or generation-based evaluation (algorithm {_names(lambda a: a.generates)}; "
                   f"or evaluation.prompts set with algorithm {_names(_OFFLINE_POLICY)})",
                   AnyOf(GENERATES, OFFLINE_EVAL))


def _per_entry(field: str) -> list[tuple[str, Cond]]:
    return [(a.name, getattr(a, field)) for a in ENTRIES if getattr(a, field) is not NEVER]


# Frozen models (alignax.trainers.engine.precision.frozen_params): a reference policy (each
# entry's ``reference``), the models online training scores with (reward models, an LLM
# judge) and an entry's own scoring models (GRPO's PRM).
FROZEN_MODELS = Named(
    "a frozen model: a reference policy ("
    + "; ".join(f"algorithm {n} with {c.text}" for n, c in _per_entry("reference"))
    + ") or a scoring model (rewards.reward_models, rewards.judge_model or rewards.prm with online training; "
    + "; ".join(c.text for _, c in _per_entry("scorers")) + ")",
    AnyOf(*(All(named(n), c) for n, c in _per_entry("reference") + _per_entry("scorers")),
          All(ONLINE, AnyOf(Given("rewards.reward_models"), Given("rewards.judge_model"), Given("rewards.prm")))))

# A reference policy held as a model of its own during training (alignax.parallel.placement
# places it): not a precomputed table of its log-probs.
_LIVE = [(a.name, All(a.reference, IsNot(a.precomputed_reference.path, *a.precomputed_reference.values))
          if isinstance(a.precomputed_reference, Is) else a.reference) for a in ENTRIES if a.reference is not NEVER]
LIVE_REFERENCE = Named(
    "a live reference policy (" + "; ".join(f"algorithm {n} with {c.text}" for n, c in _LIVE) + ")",
    AnyOf(*(All(named(n), c) for n, c in _LIVE)))


# A policy loss that holds its ratio to a bound (each entry's ``clips``; GRPO's from the
# objective registry, alignax.losses.objectives): the clip fraction the alarm reads is its.
CLIPS = Named(
    "a policy loss that clips its ratio ("
    + "; ".join(f"algorithm {n}" + ("" if c is ALWAYS else f" with {c.text}") for n, c in _per_entry("clips")) + ")",
    AnyOf(*(All(named(n), c) for n, c in _per_entry("clips"))))

def _entry_rules() -> list[Rule]:
    """Each section read by its algorithms alone, then each entry's own rows (once)."""
    sections: dict[str, list[str]] = {}
    for a in ENTRIES:
        for section in a.sections:
            sections.setdefault(section, []).append(a.name)
    out = [rule(section, named(*names)) for section, names in sections.items()]
    for a in ENTRIES:
        out += [r for r in a.rules if r not in out]
    return out


def _gold_reward_rules() -> list[Rule]:
    """The rows of ``rewards.*`` that hold for any reward config, at ``monitor.gold.rewards``
    (the gold scorer is one more :class:`RewardConfig`)."""
    g = "monitor.gold.rewards."
    return [
        rule(f"{g}mask_truncated", NEVER, "gold completions are scored, never trained on"),
        rule(f"{g}strict_format", NonZero(f"{g}format_weight")),
        rule([f"{g}answer_tag", f"{g}answer_extraction", f"{g}task"],
             AnyOf(NonZero(f"{g}verifier_weight"), NonZero(f"{g}format_weight")), "the verifiers read them"),
        rule([f"{g}reward_model_weight", f"{g}ensemble"], Given(f"{g}reward_models")),
        rule(f"{g}ensemble_k", All(Given(f"{g}reward_models"), Is(f"{g}ensemble", "mean_minus_std", "mean_minus_var"))),
        rule([f"{g}judge_weight", f"{g}judge_rubric", f"{g}judge_verdicts", f"{g}judge_score"],
             Given(f"{g}judge_model"), "they configure the LLM judge"),
        rule([f"{g}prm_weight", f"{g}prm_aggregation", f"{g}step_delimiter"], Given(f"{g}prm"),
             "they configure the process reward model"),
        rule(f"{g}length_target", NonZero(f"{g}length_penalty_coef")),
        rule(f"{g}overlong_scale", Given(f"{g}overlong_buffer")),
    ]


KEY_RULES: tuple[Rule, ...] = (
    # --- shared by every algorithm
    rule(["algorithm", "output_dir", "model", "precision", "placement", "optim", "train", "checkpoint", "logging",
          "mesh", "distributed"], ALWAYS),
    rule(["model.param_dtype", "model.dtype"], NEVER,
         "the dtypes moved to the precision section: set precision.param_dtype and precision.compute_dtype"),
    rule("precision.master_dtype", Is("precision.param_dtype", "bfloat16"),
         "float32 parameters are their own master copy"),
    rule("precision.mu_dtype", Is("optim.name", "adamw", "adam"), "it is the dtype of Adam's first moment"),
    rule("precision.frozen_dtype", AnyOf(FROZEN_MODELS, Given("lora")),
         "it is the dtype of frozen weights: a reference, reward models, or a LoRA run's base"),
    rule("placement.reference", All(LIVE_REFERENCE, AnyOf(Is("lora", None), where(lambda a: a.teacher is not None))),
         "it places the frozen reference policy; with lora the reference is the base itself, adapters off (a "
         "distillation teacher, a model of its own, is placed with or without lora)"),
    rule("placement.reward_models", Given("rewards.reward_models"), "it places the models of rewards.reward_models"),
    rule("placement.submesh", AnyOf(Is("placement.reference", "submesh"), Is("placement.reward_models", "submesh")),
         "it is the shape of the devices set apart for the models placed on submesh (placement.reference or "
         "placement.reward_models: submesh)"),
    rule("lora", where(lambda a: a.lora), f"adapters train {_names(lambda a: a.lora)} runs"),
    rule("data.packing", where(lambda a: a.packs_examples),
         f"packed rows (several examples each, kept apart by segment ids) are read by "
         f"{_names(lambda a: a.packs_examples)}"),
    rule("lora.merge_for_sampling", ONLINE,
         "it merges the adapters for the rollouts' sampler; an offline run's evaluation samples unmerged"),
    rule("lora.quant_block_size", IsNot("lora.quantize", "none"),
         "it is the block size of a quantised base (lora.quantize: int8 | nf4)"),
    rule("model.logprob_chunk_size", except_where(lambda a: a.head == "scalar" or a.teacher is not None),
         "a reward model scores sequences, no log-probs; distillation compares whole next-token distributions"),
    rule("model.seed", AnyOf(Given("model.random_init"), where(lambda a: a.head == "scalar")),
         "it seeds random initialisation and a reward model's fresh score head"),
    rule("optim.weight_decay", Is("optim.name", "adamw")),
    rule(["optim.b1", "optim.b2", "optim.eps"], Is("optim.name", "adamw", "adam")),
    rule("optim.min_lr_ratio", Is("optim.schedule", "cosine", "linear"), "the constant schedule does not decay"),
    rule("checkpoint.resume_step", Is("checkpoint.resume", True), "it picks the step a run resumes from"),
    rule("train.eval_batches", OFFLINE,
         "it caps the offline eval split's loss batches; online runs evaluate by generation (evaluation.*)"),
    # --- data (the run's; PPO-ptx's is its entry's, the evaluation prompts' below)
    *data_checks.key_rules("data"),
    # --- each algorithm's own sections, then its own rows (alignax.trainers.algorithms)
    *_entry_rules(),
    # --- generation (online rollouts; evaluation reuses the budget and stop tokens)
    rule(keys_of(RolloutSection, "rollout", but=("max_new_tokens", "stop_token_ids", "temperature", "top_k", "top_p",
                                                 "num_samples")), ONLINE),
    rule(["rollout.temperature", "rollout.top_k", "rollout.top_p", "rollout.num_samples"], GENERATES,
         "they are the sampling distribution of rollouts (an iterative run: of each round's pairs)"),
    rule(["rollout.max_new_tokens", "rollout.stop_token_ids"], GENERATION),
    rule("rollout.pack_groups", Above("rollout.num_samples", 1), "one sample per prompt has no group to pack"),
    rule("rollout.tis_cap", AnyOf(Is("rollout.old_logps", "recompute"), Is("grpo.policy_loss", *_RATIO_FREE)),
         "with the sampler's log-probs as the old ones (verl's bypass mode) an objective's own ratio pi_theta / "
         "pi_sampler is the importance correction; only an objective without one takes the explicit weight"),
    rule("rollout.tis_level", Given("rollout.tis_cap"), "it is the truncated weight's level"),
    rule("rollout.tis_lower", Given("rollout.tis_cap"), "IcePop's weight is bounded by the two"),
    rule("rollout.tis_batch_normalize", Given("rollout.tis_cap"), "it rescales the truncated weights"),
    rule("rollout.rejection_bounds", Is("rollout.rejection", "token", "sequence", "geometric"),
         "they bound the one criterion a name sets; a mapping rollout.rejection holds each criterion's own bounds"),
    rule("rollout.max_logprob_gap",
         All(Is("rollout.top_k", 0), Is("rollout.top_p", 1.0), Is("rollout.async.max_staleness", 0)),
         "it bounds how far the learner's log-probs are from the sampler's on the same weights; under top-k/top-p "
         "the sampler's are of the truncated distribution, and an asynchronous batch's of older weights"),
    # --- rewards (alignax.rewards.composite): every rollout and every generation-based
    # evaluation is scored (under grpo.advantage=process too: the logged rewards, dynamic
    # sampling's group variance and the evaluation read them; the advantages do not)
    rule(keys_of(RewardConfig, "rewards", but=("mask_truncated",)), GENERATION),
    rule(keys_of(RewardConfig, "rewards", but=("mask_truncated",)), NO_ENV,
         "with an environment (env.name set) the environment gives the rewards"),
    rule("rewards.mask_truncated", ONLINE, "it takes truncated completions out of the training loss"),
    rule("rewards.strict_format", NonZero("rewards.format_weight")),
    rule(["rewards.answer_tag", "rewards.answer_extraction", "rewards.task"],
         AnyOf(NonZero("rewards.verifier_weight"), NonZero("rewards.format_weight")), "the verifiers read them"),
    rule(["rewards.reward_model_weight", "rewards.ensemble"], Given("rewards.reward_models")),
    rule("rewards.ensemble_k", All(Given("rewards.reward_models"),
                                   Is("rewards.ensemble", "mean_minus_std", "mean_minus_var"))),
    rule(["rewards.judge_weight", "rewards.judge_rubric", "rewards.judge_verdicts", "rewards.judge_score"],
         Given("rewards.judge_model"), "they configure the LLM judge"),
    rule(["rewards.prm_weight", "rewards.prm_aggregation", "rewards.step_delimiter"], Given("rewards.prm"),
         "they configure the process reward model"),
    rule("rewards.length_target", NonZero("rewards.length_penalty_coef")),
    rule("rewards.overlong_scale", Given("rewards.overlong_buffer")),
    # --- multi-turn rollouts with an environment (alignax.envs)
    rule("env", ONLINE, "environments play the turns of online rollouts"),
    rule(["env.kwargs", "env.max_turns", "env.max_turn_tokens", "env.max_observation_tokens"], Given("env.name"),
         "they configure the environment env.name names"),
    # --- generation-based evaluation (alignax.evaluation)
    rule("evaluation", GENERATION),
    rule("evaluation.temperature", AnyOf(Given("evaluation.pass_k"), Above("evaluation.best_of_n.n", 0)),
         "it is the temperature of the pass@k and best-of-N samples"),
    rule(keys_of(BestOfNConfig, "evaluation.best_of_n", but=("n",)), Above("evaluation.best_of_n.n", 0),
         "best-of-N is off while evaluation.best_of_n.n is 0"),
    rule(["evaluation.best_of_n.ensemble", "evaluation.best_of_n.ensemble_k"],
         Given("evaluation.best_of_n.reward_models"), "they combine the reward models' scores"),
    rule("evaluation.best_of_n.ensemble_k", Is("evaluation.best_of_n.ensemble", "mean_minus_std", "mean_minus_var")),
    rule(["evaluation.best_of_n.prm_aggregation", "evaluation.best_of_n.step_delimiter"],
         Given("evaluation.best_of_n.prm"), "they read the PRM's step scores"),
    *data_checks.key_rules("evaluation.prompts"),
    rule(["evaluation.prompts.eval_fraction", "evaluation.prompts.shuffle", "evaluation.prompts.seed",
          "evaluation.prompts.num_epochs"], NEVER, "an evaluation reads its prompt set once, whole, in file order"),
    # --- alarms, their actions, the KL budget and the gold signal (alignax.trainers.online.guard)
    rule("monitor", ONLINE, "the alarms watch online rollouts"),
    rule(["monitor.gold.every", "monitor.gold.max_prompts", "monitor.gold.rewards", "monitor.gold_divergence",
          "monitor.plot"], Given("monitor.gold.prompts"), "the gold signal is the held-out monitor.gold.prompts, scored"),
    rule("monitor.rollback", Named("an alarm whose action is rollback (monitor.<alarm>.action=rollback)",
                                   AnyOf(*(Is(f"monitor.{a}.action", "rollback") for a in monitor_settings.ALARMS))),
         "it says what a rollback does"),
    rule("monitor.clip_fraction", CLIPS, "the alarm reads the clip fraction, which a loss without a clip logs as 0"),
    rule("monitor.kl_budget", LIVE_REFERENCE, "it bounds the KL to the reference policy"),
    rule(["monitor.kl_budget.action", "monitor.kl_budget.beta_factor"], Given("monitor.kl_budget.max"),
         "they say what happens over the budget"),
    rule("monitor.kl_budget.beta_factor", Is("monitor.kl_budget.action", "raise_beta")),
    *_gold_reward_rules(),
    *data_checks.key_rules("monitor.gold.prompts"),
    rule(["monitor.gold.prompts.eval_fraction", "monitor.gold.prompts.shuffle", "monitor.gold.prompts.seed",
          "monitor.gold.prompts.num_epochs"], NEVER, "the gold set is read once, whole, in file order"),
)

"""Every key of the schema -> when the run reads it (all matching rows must hold)."""


@functools.cache
def rules_covering(key: str) -> tuple[Rule, ...]:
    """The rows of :data:`KEY_RULES` that cover ``key``, in table order (looked up once per
    key: validation runs for every set key of every config a sweep builds)."""
    return tuple(r for r in KEY_RULES if r.covers(key))


# ---------------------------------------------------------------------------- value constraints
def _data_format(config):
    formats, by = algorithm(config.algorithm).data_formats(config)
    if config.data.format not in formats:
        return (f"data.format={config.data.format} does not fit {by}: it reads data.format="
                f"{' or '.join(formats)} (algorithm {config.algorithm})")
    return None


def _eval_prompts_format(config):
    prompts = config.evaluation.prompts
    if prompts is not None and prompts.format != "prompt":
        return f"evaluation.prompts.format={prompts.format}: an evaluation reads a prompt set (format prompt)"
    return None


def _online_section(config):
    """An online family's own section (its ``epochs``, ``minibatches``): its entry's first."""
    return algorithm(config.algorithm).sections[0]


def _minibatches(config):
    if not ONLINE(config):
        return None
    name = _online_section(config)
    minibatches = getattr(config, name).minibatches
    rows = config.data.batch_size * config.rollout.num_samples
    if rows % minibatches:
        return (f"{name}.minibatches={minibatches} does not divide the {rows} rollout rows (data.batch_size="
                f"{config.data.batch_size} x rollout.num_samples={config.rollout.num_samples})")
    accum = config.train.grad_accum_steps
    if (rows // minibatches) % accum:
        return (f"train.grad_accum_steps={accum} does not divide the {rows // minibatches} rows of a "
                f"minibatch (data.batch_size x rollout.num_samples / {name}.minibatches)")
    return None


def _offline_micro_batches(config):
    accum = config.train.grad_accum_steps
    if not ONLINE(config) and config.data.batch_size % accum:
        return (f"train.grad_accum_steps={accum} does not divide data.batch_size={config.data.batch_size} "
                f"(algorithm {config.algorithm})")
    return None


def _packed_groups(config):
    rc = config.rollout
    if not ONLINE(config) or rc.pack_groups != "on" or rc.num_samples < 2:
        return None
    name = _online_section(config)
    minibatches = getattr(config, name).minibatches
    prompts, accum = config.data.batch_size, config.train.grad_accum_steps
    if prompts % minibatches or (prompts * rc.num_samples // minibatches // accum) % rc.num_samples:
        return (f"rollout.pack_groups=on needs whole groups of rollout.num_samples={rc.num_samples} in every "
                f"minibatch and micro-batch: data.batch_size={prompts} prompts into "
                f"{name}.minibatches={minibatches} x train.grad_accum_steps={accum} do not give that; "
                "use pack_groups auto/off or change the split")
    return None


def _async_rollouts(config):
    """Bounded staleness (``rollout.async.max_staleness > 0``) needs the behaviour log-probs in
    the loss and prompts the sampler can take ahead of the learner."""
    rc, k = config.rollout, config.rollout.async_.max_staleness
    if ONLINE(config) and k == 0 and rc.async_.devices:
        return (f"rollout.async.devices={rc.async_.devices} gives the sampler devices of its own, which only an "
                "asynchronous schedule keeps busy; set rollout.async.max_staleness >= 1 or devices 0")
    if not ONLINE(config) or k == 0:
        return None
    if rc.async_.devices and rc.mesh is not None and -1 not in rc.mesh and math.prod(rc.mesh) != rc.async_.devices:
        return (f"rollout.mesh={list(rc.mesh)} spans {math.prod(rc.mesh)} devices; the sampler's group "
                f"(rollout.async.devices) has {rc.async_.devices}")
    section = _online_section(config)
    if getattr(getattr(config, section), "dynamic_sampling", False):
        return (f"rollout.async.max_staleness={k} with {section}.dynamic_sampling=true: the "
                "refills read prompt batches in step with the learner; use max_staleness 0 or turn it off")
    if rc.old_logps == "recompute" and rc.tis_cap is None:
        return (f"rollout.async.max_staleness={k} with rollout.old_logps=recompute and no rollout.tis_cap would "
                "ignore the behaviour policy's log-probs; set rollout.old_logps=sampler or a rollout.tis_cap")
    return None


def _reward_source(config):
    r = config.rewards
    no_verifier = r.verifier_weight == 0 and r.format_weight == 0
    if GENERATION(config) and no_verifier and not r.functions and not r.reward_models and not r.judge_model \
            and not r.prm:
        return ("rewards: no reward source (rewards.verifier_weight and rewards.format_weight are 0, no "
                "rewards.functions, no rewards.reward_models, no rewards.judge_model, no rewards.prm); set one of them")
    return None


def _env_settings(config):
    env = config.env
    if env.name is None or not ONLINE(config):
        return None
    if env.max_turn_tokens is not None and env.max_turn_tokens > config.rollout.max_new_tokens:
        return (f"env.max_turn_tokens={env.max_turn_tokens} exceeds rollout.max_new_tokens="
                f"{config.rollout.max_new_tokens}, the budget of the whole trajectory after the prompt")
    return None


def _overlong_buffer(config):
    buffer, budget = config.rewards.overlong_buffer, config.rollout.max_new_tokens
    if GENERATION(config) and buffer is not None and not 0 < buffer <= budget:
        return f"rewards.overlong_buffer={buffer} must be in (0, rollout.max_new_tokens={budget}]"
    return None


def _pass_k_verdict(config):
    ev, r = config.evaluation, config.rewards
    if (GENERATION(config) and ev.pass_k and ev.success_threshold is None
            and r.verifier_weight == 0 and r.format_weight == 0):
        return ("evaluation.pass_k needs a verdict on each completion: a verifier (rewards.verifier_weight or "
                "rewards.format_weight != 0) or evaluation.success_threshold")
    if (GENERATION(config) and ev.best_of_n.n and ev.success_threshold is None
            and r.verifier_weight == 0 and r.format_weight == 0):
        return ("evaluation.best_of_n.n needs a verdict on each completion: a verifier (rewards.verifier_weight or "
                "rewards.format_weight != 0) or evaluation.success_threshold")
    return None


def _checkpoint_keep(config):
    keep = config.checkpoint.keep
    if keep < 1:
        return (f"checkpoint.keep={keep}: it is how many of the newest step checkpoints are kept, and {keep} would "
                "delete every one; set checkpoint.keep >= 1 (or checkpoint.enabled=false to save none)")
    return None


def _mesh_shape(config):
    shape = tuple(config.mesh.shape)
    for axis, size in zip(MESH_AXES, shape):
        if size < 1 and size != -1:
            return (f"mesh.shape={show(shape)}: the {axis} entry is {size}; each entry must be >= 1, or -1 for "
                    "the remaining devices")
    if shape.count(-1) > 1:
        axes = ", ".join(a for a, n in zip(MESH_AXES, shape) if n == -1)
        return (f"mesh.shape={show(shape)}: {shape.count(-1)} entries are -1 ({axes}); at most one axis may take "
                "the remaining devices, give the others a size >= 1")
    dcn = config.mesh.dcn_shape
    if dcn is not None and any(size < 1 for size in dcn):
        axis = next(a for a, n in zip(MESH_AXES, dcn) if n < 1)
        return (f"mesh.dcn_shape={show(tuple(dcn))}: the {axis} entry is {dict(zip(MESH_AXES, dcn))[axis]}; each "
                "entry is how many slices the axis spans (>= 1; their product is the slice count)")
    return None


def _submesh(config):
    placement = config.placement
    roles = [f"placement.{role}" for role in SUBMESH_ROLES if placement.on_submesh(role)]
    if not roles:
        return None
    if placement.submesh is None:
        return (f"{roles[0]}=submesh needs placement.submesh: the shape [data, fsdp, tensor] of the devices set "
                "apart for it (e.g. [1, 2, 1]: two devices of their own, the rest train)")
    if min(placement.submesh) < 1:
        return (f"placement.submesh={show(tuple(placement.submesh))}: each entry is a number of devices (>= 1, "
                "no -1: the training mesh takes the remaining devices)")
    if config.mesh.dcn_shape is not None:
        return ("placement.submesh with mesh.dcn_shape: a multi-slice mesh spans every device of every slice; "
                "place the frozen models on device or host instead")
    if placement.on_submesh("reward_models") and not ONLINE(config):
        return (f"placement.reward_models=submesh with algorithm {config.algorithm}: only online training's "
                "rollout scoring runs reward models on a sub-mesh (an evaluation loads them on its own mesh)")
    return None


def _reward_task(config):
    task = config.rewards.task
    if task is None:
        return None
    try:
        check_task(task)
    except ValueError as err:
        return f"rewards.task={task}: {err}"
    return None


def _model_folder(config):
    return registry.model_folder_problem(config.model.name, random_init=config.model.random_init is not None)


def _own_scoring_models(config) -> list[tuple[str, str]]:
    """``(key, folder)`` of the frozen scoring models the algorithm's entry holds beyond
    ``rewards:`` (its ``scorers``: GRPO's process reward model), where they are set."""
    cond = algorithm(config.algorithm).scorers
    return [(cond.path, config_get(config, cond.path))] if isinstance(cond, Given) and cond(config) else []


def _monitor(config):
    """The monitor's values: in range, a rollback with a gold set to pick its checkpoint by, a
    gold scorer that is not the training reward, a KL coefficient for the factors to move."""
    if not ONLINE(config):
        return None
    return monitor_settings.problem(config, _online_section(config), trained_models=_own_scoring_models(config),
                                    trains_on_rewards=algorithm(config.algorithm).trains_on_rewards(config))


def _data_files(config):
    formats, by = algorithm(config.algorithm).data_formats(config)
    return data_checks.data_file_problem(config.data, "data", by, formats)


def _eval_prompts_files(config):
    if not GENERATION(config):
        return None
    return data_checks.data_file_problem(config.evaluation.prompts, "evaluation.prompts", "an evaluation", ("prompt",))


CONSTRAINTS: tuple[Callable[[TrainConfig], str | None], ...] = (
    _data_format,
    _eval_prompts_format,
    _minibatches,
    _offline_micro_batches,
    _packed_groups,
    _async_rollouts,
    _reward_source,
    _overlong_buffer,
    _env_settings,
    _pass_k_verdict,
    _checkpoint_keep,
    _mesh_shape,
    _submesh,
    _reward_task,
    _model_folder,
    _data_files,
    _eval_prompts_files,
    _monitor,
)
"""Each returns the problem in words (naming its keys), or None."""


# ---------------------------------------------------------------------------- the schema
def schema_keys(cls: type = TrainConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the run config (:func:`alignax.config.schema_keys`)."""
    return config_schema_keys(cls, prefix)


def unusable_keys(config: TrainConfig) -> list[Unusable]:
    """The set keys whose rows of :data:`KEY_RULES` do not all hold, in schema order
    (:func:`alignax.config.unusable_keys`)."""
    return _unusable_keys(config, rules_covering)


def problems(config: TrainConfig) -> list[str]:
    """Every problem :func:`validate` would report, one sentence each."""
    out = []
    groups: dict[int, list[Unusable]] = {}
    for u in unusable_keys(config):
        groups.setdefault(id(u.rule), []).append(u)
    for items in groups.values():
        r, one = items[0].rule, len(items) == 1
        keys = ", ".join(u.key for u in items)
        why = f" ({r.why})" if r.why else ""
        defaults = [f"{u.key}: {show(u.default)}" for u in items if u.default is not None]
        remove = f"remove {'it' if one else 'them'}" + (f" (default {', '.join(defaults)})" if defaults else "")
        if r.when is NEVER:
            out.append(f"{keys} {'is' if one else 'are'} read by no run{why}; {remove}")
            continue
        settable = not isinstance(r.when, (Named, Check)) and "algorithm" not in r.when.text
        fix = remove + (f", or set {r.when.text}" if settable else "")
        out.append(f"{keys} {'applies' if one else 'apply'} to {r.when.text} only; got {r.when.got(config)}{why}. "
                   f"Algorithm {config.algorithm} would ignore {'it' if one else 'them'}: {fix}")
    for constraint in (*CONSTRAINTS, *algorithm(config.algorithm).constraints):
        message = constraint(config)
        if message:
            out.append(message)
    return out


def validate(config: TrainConfig) -> None:
    """Raise :class:`~alignax.config.ConfigError` naming every key the run cannot use and
    every pair of values that disagree (see the module docstring); return None otherwise."""
    found = problems(config)
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError(f"{len(found)} problems in the config:\n" + "\n".join(f"- {p}" for p in found))


__all__ = ["CONSTRAINTS", "FROZEN_MODELS", "GENERATION", "KEY_RULES", "LIVE_REFERENCE", "ONLINE", "problems",
           "schema_keys", "set_keys", "unusable_keys", "validate"]
