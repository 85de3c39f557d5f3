"""Cross-field validation of a run config, before any model is read.

``alignax.trainers.api.load_config`` calls :func:`validate` on every ``TrainConfig`` it builds. Two tables say
what a valid config is:

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
- :data:`CONSTRAINTS`: values that must agree with each other (``data.format`` with the
  algorithm, batch sizes that split into minibatches and micro-batches, ...), values out
  of range (``checkpoint.keep``, ``mesh.shape``, ``rewards.task``), and a cheap look at the
  local files a run would read later: a ``model.name`` folder lacking config.json, weights
  or tokenizer files; a data file (``data.paths``, ``ppo.ptx_data.paths``,
  ``evaluation.prompts.paths``) that is empty, or whose first record has the fields of
  another format than the section's ``format``. Generator specs, folders and paths that
  do not exist are left to the data pipeline and the model loader, which name them.

Every error is a :class:`~alignax.config.ConfigError` naming the dotted key(s), the
algorithm, the setting that makes the key unusable, and what would be right.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import os
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from alignax import paths
from alignax.best_of_n import BestOfNConfig
from alignax.config import ConfigError, type_hints
from alignax.data.builders import is_generator_spec
from alignax.data.formats import DEFAULT_FIELDS, FORMATS, OPTIONAL_FIELDS
from alignax.data.sources import DATA_FILE_SUFFIXES
from alignax.losses.preference import DPO_VARIANTS
from alignax.models import registry
from alignax.parallel.placement import SUBMESH_ROLES
from alignax.parallel.sharding import MESH_AXES
from alignax.rewards.composite import RewardConfig
from alignax.rewards.verifiers import check_task
from alignax.trainers.config import RolloutSection, TrainConfig

_MISSING = object()


def get(config: Any, path: str) -> Any:
    """The value at a dotted ``path`` of ``config`` (``_MISSING`` through a null section)."""
    value = config
    for part in path.split("."):
        if value is None:
            return _MISSING
        value = getattr(value, part)
    return value


def show(value: Any) -> str:
    """A value as a recipe writes it."""
    if value is None or value is _MISSING:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{...}"
    return str(value)


# ---------------------------------------------------------------------------- conditions
class Cond(abc.ABC):
    """A condition on a config: ``cond(config) -> bool``; ``text`` says it in recipe terms,
    ``got(config)`` the values that make it fail."""

    text: str

    @abc.abstractmethod
    def __call__(self, config: TrainConfig) -> bool:
        """Whether the condition holds for ``config``."""

    @abc.abstractmethod
    def got(self, config: TrainConfig) -> str:
        """The values of ``config`` that the condition reads, in recipe terms."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.text}>"


class Is(Cond):
    """``path`` holds one of ``values``."""

    def __init__(self, path: str, *values: Any):
        self.path, self.values = path, values
        self.text = f"{path}={'|'.join(show(v) for v in values)}"

    def __call__(self, config):
        return get(config, self.path) in self.values

    def got(self, config):
        return f"{self.path}={show(get(config, self.path))}"


class IsNot(Is):
    """``path`` holds none of ``values``."""

    def __init__(self, path: str, *values: Any):
        super().__init__(path, *values)
        self.text = f"{path} other than {'/'.join(show(v) for v in values)}"

    def __call__(self, config):
        return get(config, self.path) not in self.values


class Above(Is):
    """``path`` > ``bound``."""

    def __init__(self, path: str, bound: float = 0):
        super().__init__(path)
        self.bound = bound
        self.text = f"{path} > {show(bound)}"

    def __call__(self, config):
        value = get(config, self.path)
        return value is not None and value is not _MISSING and value > self.bound


class NonZero(Is):
    """``path`` != 0."""

    def __init__(self, path: str):
        super().__init__(path)
        self.text = f"{path} != 0"

    def __call__(self, config):
        return get(config, self.path) != 0


class Given(Is):
    """``path`` is set: not null, not empty."""

    def __init__(self, path: str):
        super().__init__(path)
        self.text = f"{path} set"

    def __call__(self, config):
        value = get(config, self.path)
        return value is not _MISSING and value is not None and value != () and value != {}

    def got(self, config):
        value = get(config, self.path)
        return f"{self.path}={'[]' if value == () else '{}' if value == {} else show(value)}"


class All(Cond):
    def __init__(self, *conds: Cond):
        self.conds = conds
        self.text = " and ".join(c.text for c in conds)

    def __call__(self, config):
        return all(c(config) for c in self.conds)

    def got(self, config):
        return next(c.got(config) for c in self.conds if not c(config))


class AnyOf(Cond):
    def __init__(self, *conds: Cond):
        self.conds = conds
        self.text = " or ".join(f"({c.text})" if isinstance(c, (All, AnyOf)) else c.text for c in conds)

    def __call__(self, config):
        return any(c(config) for c in self.conds)

    def got(self, config):
        seen = []
        for c in self.conds:
            for part in c.got(config).split(", "):
                if part and part not in seen:
                    seen.append(part)
        return ", ".join(seen)


class Named(Cond):
    """``cond`` said in words (``text``)."""

    def __init__(self, text: str, cond: Cond):
        self.text, self.cond = text, cond

    def __call__(self, config):
        return self.cond(config)

    def got(self, config):
        return self.cond.got(config)


class Check(Cond):
    """A condition computed by ``fn``; ``got_fn`` says the values it read."""

    def __init__(self, text: str, fn: Callable[[TrainConfig], bool], got_fn: Callable[[TrainConfig], str]):
        self.text, self.fn, self.got_fn = text, fn, got_fn

    def __call__(self, config):
        return self.fn(config)

    def got(self, config):
        return self.got_fn(config)


ALWAYS = Check("any run", lambda c: True, lambda c: "")
NEVER = Check("no run", lambda c: False, lambda c: "")

ONLINE = Is("algorithm", "grpo", "ppo")
OFFLINE = Is("algorithm", "sft", "reward", "prm", "dpo")
EVAL_PROMPTS = Given("evaluation.prompts")
NO_ENV = Named("no environment (env.name null)", Is("env.name", None))
# alignax.evaluation: an online run evaluates by generation (on its eval split, or on
# evaluation.prompts); an offline policy only on evaluation.prompts (its data are not
# prompts), and a reward model never (it does not generate).
OFFLINE_EVAL = All(Is("algorithm", "sft", "dpo"), EVAL_PROMPTS)
ITERATIVE = Is("algorithm", "iterative_dpo")  # samples pairs from the policy each round
GENERATION = Named("online training or generation-based evaluation (algorithm grpo, ppo or iterative_dpo; or "
                   "evaluation.prompts set with algorithm sft or dpo)", AnyOf(ONLINE, ITERATIVE, OFFLINE_EVAL))


def _paths_read_from_disk(prefix: str) -> Check:
    return Check(
        f"a {prefix}.paths entry that is a file or folder (not a generator spec)",
        lambda c: any(not is_generator_spec(p) for p in (get(c, f"{prefix}.paths") or ())),
        lambda c: f"{prefix}.paths={show(get(c, prefix + '.paths'))}",
    )


# ---------------------------------------------------------------------------- the key table
@dataclasses.dataclass(frozen=True)
class Rule:
    """``keys`` (dotted leaves, or a section: all keys under it) are read when ``when``
    holds; ``why``: the reason in words, for the error message."""

    keys: tuple[str, ...]
    when: Cond
    why: str = ""

    def covers(self, key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in self.keys)


def rule(keys: str | Sequence[str], when: Cond, why: str = "") -> Rule:
    return Rule((keys,) if isinstance(keys, str) else tuple(keys), when, why)


def _keys_of(cls: type, prefix: str, *, but: Sequence[str] = ()) -> list[str]:
    """The keys of section ``cls`` at ``prefix`` except ``but``."""
    return [f"{prefix}.{f.name}" for f in dataclasses.fields(cls) if f.name not in but]


def _data_rules(prefix: str) -> list[Rule]:
    """The rows of a ``DataConfig`` at ``prefix`` (``data``, ``ppo.ptx_data``, ``evaluation.prompts``)."""
    fmt = f"{prefix}.format"
    return [
        rule(prefix, ALWAYS),
        rule([f"{prefix}.max_length", f"{prefix}.max_response_length"], IsNot(fmt, "prompt"),
             "prompt batches are max_prompt_length wide; the response budget is rollout.max_new_tokens"),
        rule(f"{prefix}.step_delimiter", Is(fmt, "steps"), "it separates the steps of a step-labelled solution"),
        rule(f"{prefix}.apply_chat_template", Is(fmt, "preference", "unpaired", "prompt", "steps"),
             "sft messages always go through the chat template; text never does"),
        rule(f"{prefix}.system_prompt", IsNot(fmt, "text"), "plain text has no conversation to put it in"),
        rule(f"{prefix}.split", _paths_read_from_disk(prefix), "a generator spec has no splits"),
        rule(f"{prefix}.prefetch_batches", Above(f"{prefix}.read_threads", 0),
             "batches are prefetched by the reading threads"),
    ]


_PREF_SMOOTHED = ("sigmoid", "robust", "exo_pair")  # alignax.losses.preference: eps of these only

# Frozen models (alignax.trainers.engine.precision.frozen_params): the reference policy of
# the DPO family and of online RL with a KL, and the models online training scores with
# (reward models, an LLM judge, a PRM as GRPO's process reward).
FROZEN_MODELS = Named(
    "a frozen model: a reference policy (algorithm dpo with dpo.loss=dpo|kto; grpo.kl_coef > 0; ppo.kl_coef > 0) "
    "or a scoring model of online training (rewards.reward_models or rewards.judge_model with algorithm grpo|ppo; "
    "grpo.process_reward_model)",
    AnyOf(All(Is("algorithm", "dpo", "iterative_dpo"), Is("dpo.loss", "dpo", "kto")),
          All(Is("algorithm", "grpo"), Above("grpo.kl_coef", 0)),
          All(Is("algorithm", "ppo"), Above("ppo.kl_coef", 0)),
          All(ONLINE, AnyOf(Given("rewards.reward_models"), Given("rewards.judge_model"))),
          All(Is("algorithm", "grpo"), Given("grpo.process_reward_model"))))

# A reference policy held as a model of its own during training (alignax.parallel.placement
# places it): not a precomputed table of its log-probs.
LIVE_REFERENCE = Named(
    "a live reference policy (algorithm dpo|iterative_dpo with dpo.loss=dpo|kto and dpo.reference=live; "
    "grpo.kl_coef > 0; ppo.kl_coef > 0)",
    AnyOf(All(Is("algorithm", "dpo", "iterative_dpo"), Is("dpo.loss", "dpo", "kto"), Is("dpo.reference", "live")),
          All(Is("algorithm", "grpo"), Above("grpo.kl_coef", 0)),
          All(Is("algorithm", "ppo"), Above("ppo.kl_coef", 0))))

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
    rule("placement.reference", All(LIVE_REFERENCE, Is("lora", None)),
         "it places the frozen reference policy; with lora the reference is the base itself, adapters off"),
    rule("placement.reward_models", Given("rewards.reward_models"), "it places the models of rewards.reward_models"),
    rule("placement.submesh", AnyOf(Is("placement.reference", "submesh"), Is("placement.reward_models", "submesh")),
         "it is the shape of the devices set apart for the models placed on submesh (placement.reference or "
         "placement.reward_models: submesh)"),
    rule("lora", Is("algorithm", "sft", "dpo", "reward", "grpo", "ppo"),
         "adapters train sft, dpo, reward, grpo and ppo runs"),
    rule("lora.merge_for_sampling", ONLINE,
         "it merges the adapters for the rollouts' sampler; an offline run's evaluation samples unmerged"),
    rule("lora.quant_block_size", IsNot("lora.quantize", "none"),
         "it is the block size of a quantised base (lora.quantize: int8 | nf4)"),
    rule("model.logprob_chunk_size", IsNot("algorithm", "reward", "prm"), "a reward model scores sequences, no log-probs"),
    rule("model.seed", AnyOf(Given("model.random_init"), Is("algorithm", "reward", "prm")),
         "it seeds random initialisation and a reward model's fresh score head"),
    rule("optim.weight_decay", Is("optim.name", "adamw")),
    rule(["optim.b1", "optim.b2", "optim.eps"], Is("optim.name", "adamw", "adam")),
    rule("optim.min_lr_ratio", Is("optim.schedule", "cosine", "linear"), "the constant schedule does not decay"),
    rule("checkpoint.resume_step", Is("checkpoint.resume", True), "it picks the step a run resumes from"),
    rule("train.eval_batches", OFFLINE,
         "it caps the offline eval split's loss batches; online runs evaluate by generation (evaluation.*)"),
    # --- data (the run's; PPO-ptx's and the evaluation prompts' below)
    *_data_rules("data"),
    # --- each algorithm's own section
    rule("sft", Is("algorithm", "sft")),
    rule("reward", Is("algorithm", "reward")),
    rule("prm", Is("algorithm", "prm")),
    rule("dpo", Is("algorithm", "dpo", "iterative_dpo")),
    rule("iterative", ITERATIVE),
    rule("grpo", Is("algorithm", "grpo")),
    rule("ppo", Is("algorithm", "ppo")),
    # --- DPO family (alignax.trainers.offline.preference)
    rule("dpo.variant", Is("dpo.loss", "dpo")),
    rule("dpo.label_smoothing", AnyOf(All(Is("dpo.loss", "dpo"), Is("dpo.variant", *_PREF_SMOOTHED)),
                                      Is("dpo.loss", "simpo", "cpo"))),
    rule("dpo.dpop_lambda", All(Is("dpo.loss", "dpo"), Is("dpo.variant", "dpop"))),
    rule("dpo.simpo_gamma", Is("dpo.loss", "simpo")),
    rule("dpo.cpo_alpha", Is("dpo.loss", "cpo")),
    rule(["dpo.kto_desirable_weight", "dpo.kto_undesirable_weight"], Is("dpo.loss", "kto")),
    rule("dpo.reference", Is("dpo.loss", "dpo", "kto"), "simpo, cpo and orpo have no reference model"),
    # --- GRPO family (alignax.trainers.online.grpo)
    rule("grpo.unbiased_std", Is("grpo.advantage", "grpo", "process"), "only these divide by a std"),
    rule("grpo.reinforce_baseline", Is("grpo.advantage", "reinforce_pp")),
    rule(["grpo.clip_eps_low", "grpo.clip_eps_high"], Is("grpo.policy_loss", "ppo", "gspo", "cispo"),
         "pg does not clip"),
    rule("grpo.dual_clip_c", Is("grpo.policy_loss", "ppo"), "the dual clip is PPO-clip's"),
    rule(["grpo.kl_kind", "grpo.adaptive_kl"], Above("grpo.kl_coef", 0),
         "kl_coef 0 drops the reference and the KL with it"),
    rule("grpo.kl_placement", All(Above("grpo.kl_coef", 0), IsNot("grpo.advantage", "process")),
         "process advantages read the step rewards only, never the sequence reward a KL is subtracted from"),
    rule(["grpo.kl_target", "grpo.kl_horizon"], Is("grpo.adaptive_kl", True)),
    rule("grpo.max_refills", Is("grpo.dynamic_sampling", True)),
    rule(["grpo.step_delimiter", "grpo.process_reward", "grpo.process_reward_model"], Is("grpo.advantage", "process")),
    rule("grpo.process_reward", Is("grpo.process_reward_model", None), "a trained PRM gives the step rewards"),
    rule("grpo.process_reward_aggregation", Given("grpo.process_reward_model"), "it reduces the PRM's step scores"),
    # --- PPO (alignax.trainers.online.ppo)
    rule("ppo.critic_init", Is("ppo.critic", "separate"), "a shared critic is a value head on the policy"),
    rule("ppo.critic_path", All(Is("ppo.critic", "separate"), Is("ppo.critic_init", "reward_model"))),
    rule(["ppo.kl_kind", "ppo.kl_placement", "ppo.adaptive_kl"], Above("ppo.kl_coef", 0),
         "kl_coef 0 drops the reference and the KL with it"),
    rule(["ppo.kl_target", "ppo.kl_horizon"], Is("ppo.adaptive_kl", True)),
    rule("ppo.target_kl", Above("ppo.epochs", 1), "it stops the remaining epochs of a rollout"),
    rule("ppo.ptx_coef", Given("ppo.ptx_data"), "PPO-ptx's SFT loss needs its data"),
    rule("ppo.ptx_data", Above("ppo.ptx_coef", 0), "the ptx data feed PPO-ptx's SFT loss at weight ppo.ptx_coef"),
    *_data_rules("ppo.ptx_data"),
    rule("ppo.ptx_data.eval_fraction", NEVER, "PPO-ptx reads its data's train split only"),
    # --- generation (online rollouts; evaluation reuses the budget and stop tokens)
    rule(_keys_of(RolloutSection, "rollout", but=("max_new_tokens", "stop_token_ids", "temperature", "top_k", "top_p",
                                                  "num_samples")), ONLINE),
    rule(["rollout.temperature", "rollout.top_k", "rollout.top_p", "rollout.num_samples"],
         Is("algorithm", "grpo", "ppo", "iterative_dpo"),
         "they are the sampling distribution of rollouts (iterative_dpo: of each round's pairs)"),
    rule(["rollout.max_new_tokens", "rollout.stop_token_ids"], GENERATION),
    rule("rollout.pack_groups", Above("rollout.num_samples", 1), "one sample per prompt has no group to pack"),
    rule("rollout.tis_cap", Is("rollout.old_logps", "recompute"),
         "with the sampler's log-probs as the old ones the importance weight pi_old / pi_sampler is 1"),
    # --- rewards (alignax.rewards.composite): every rollout and every generation-based
    # evaluation is scored (under grpo.advantage=process too: the logged rewards, dynamic
    # sampling's group variance and the evaluation read them; the advantages do not)
    rule(_keys_of(RewardConfig, "rewards", but=("mask_truncated",)), GENERATION),
    rule(_keys_of(RewardConfig, "rewards", but=("mask_truncated",)), NO_ENV,
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
    rule(_keys_of(BestOfNConfig, "evaluation.best_of_n", but=("n",)), Above("evaluation.best_of_n.n", 0),
         "best-of-N is off while evaluation.best_of_n.n is 0"),
    rule(["evaluation.best_of_n.ensemble", "evaluation.best_of_n.ensemble_k"],
         Given("evaluation.best_of_n.reward_models"), "they combine the reward models' scores"),
    rule("evaluation.best_of_n.ensemble_k", Is("evaluation.best_of_n.ensemble", "mean_minus_std", "mean_minus_var")),
    rule(["evaluation.best_of_n.prm_aggregation", "evaluation.best_of_n.step_delimiter"],
         Given("evaluation.best_of_n.prm"), "they read the PRM's step scores"),
    *_data_rules("evaluation.prompts"),
    rule(["evaluation.prompts.eval_fraction", "evaluation.prompts.shuffle", "evaluation.prompts.seed",
          "evaluation.prompts.num_epochs"], NEVER, "an evaluation reads its prompt set once, whole, in file order"),
)

"""Every key of the schema -> when the run reads it (all matching rows must hold)."""


@functools.cache
def rules_covering(key: str) -> tuple[Rule, ...]:
    """The rows of :data:`KEY_RULES` that cover ``key``, in table order (looked up once per
    key: validation runs for every set key of every config a sweep builds)."""
    return tuple(r for r in KEY_RULES if r.covers(key))


# ---------------------------------------------------------------------------- value constraints
def _formats_of(config: TrainConfig) -> tuple[tuple[str, ...], str]:
    """The data formats the algorithm reads, and what decides them."""
    algorithm = config.algorithm
    if algorithm == "dpo":
        if config.dpo.loss == "kto":
            return ("unpaired",), "dpo.loss=kto"
        return ("preference",), f"dpo.loss={config.dpo.loss}"
    table = {"sft": ("sft", "text"), "reward": ("preference",), "prm": ("steps",), "grpo": ("prompt",),
             "ppo": ("prompt",), "iterative_dpo": ("prompt",)}
    return tuple(f for f in table[algorithm] if f in FORMATS), f"algorithm {algorithm}"


def _data_format(config):
    formats, by = _formats_of(config)
    if config.data.format not in formats:
        return (f"data.format={config.data.format} does not fit {by}: it reads data.format="
                f"{' or '.join(formats)} (algorithm {config.algorithm})")
    return None


def _ptx_format(config):
    ptx = config.ppo.ptx_data
    formats = tuple(f for f in ("sft", "text") if f in FORMATS)
    if ptx is not None and ptx.format not in formats:
        return (f"ppo.ptx_data.format={ptx.format}: PPO-ptx's SFT loss reads ppo.ptx_data.format="
                f"{' or '.join(formats)}")
    return None


def _eval_prompts_format(config):
    prompts = config.evaluation.prompts
    if prompts is not None and prompts.format != "prompt":
        return f"evaluation.prompts.format={prompts.format}: an evaluation reads a prompt set (format prompt)"
    return None


def _group_size(config):
    if config.algorithm == "grpo" and config.grpo.advantage != "remax" and config.rollout.num_samples < 2:
        return (f"rollout.num_samples={config.rollout.num_samples}: grpo.advantage={config.grpo.advantage} compares "
                "the samples of a prompt; set rollout.num_samples >= 2 (or grpo.advantage=remax)")
    return None


def _minibatches(config):
    if config.algorithm not in ("grpo", "ppo"):
        return None
    section = config.grpo if config.algorithm == "grpo" else config.ppo
    rows = config.data.batch_size * config.rollout.num_samples
    name = f"{config.algorithm}.minibatches"
    if rows % section.minibatches:
        return (f"{name}={section.minibatches} does not divide the {rows} rollout rows (data.batch_size="
                f"{config.data.batch_size} x rollout.num_samples={config.rollout.num_samples})")
    accum = config.train.grad_accum_steps
    if (rows // section.minibatches) % accum:
        return (f"train.grad_accum_steps={accum} does not divide the {rows // section.minibatches} rows of a "
                f"minibatch (data.batch_size x rollout.num_samples / {name})")
    return None


def _offline_micro_batches(config):
    accum = config.train.grad_accum_steps
    if config.algorithm not in ("grpo", "ppo") and config.data.batch_size % accum:
        return (f"train.grad_accum_steps={accum} does not divide data.batch_size={config.data.batch_size} "
                f"(algorithm {config.algorithm})")
    return None


def _ptx_micro_batches(config):
    ptx, accum = config.ppo.ptx_data, config.train.grad_accum_steps
    if config.algorithm == "ppo" and ptx is not None and ptx.batch_size % accum:
        return f"train.grad_accum_steps={accum} does not divide ppo.ptx_data.batch_size={ptx.batch_size}"
    return None


def _packed_groups(config):
    rc = config.rollout
    if config.algorithm not in ("grpo", "ppo") or rc.pack_groups != "on" or rc.num_samples < 2:
        return None
    minibatches = (config.grpo if config.algorithm == "grpo" else config.ppo).minibatches
    prompts, accum = config.data.batch_size, config.train.grad_accum_steps
    if prompts % minibatches or (prompts * rc.num_samples // minibatches // accum) % rc.num_samples:
        return (f"rollout.pack_groups=on needs whole groups of rollout.num_samples={rc.num_samples} in every "
                f"minibatch and micro-batch: data.batch_size={prompts} prompts into "
                f"{config.algorithm}.minibatches={minibatches} x train.grad_accum_steps={accum} do not give that; "
                "use pack_groups auto/off or change the split")
    return None


def _critic_adapter(config):
    """``ppo.critic=adapter`` is a LoRA run's critic, and a LoRA PPO run's only critic."""
    if config.algorithm != "ppo":
        return None
    critic = config.ppo.critic
    if critic == "adapter" and config.lora is None:
        return ("ppo.critic=adapter is an adapter and value head on the policy's frozen base: it needs a lora "
                "section (lora.rank, ...); without LoRA set ppo.critic=separate or shared")
    if critic != "adapter" and config.lora is not None:
        return (f"ppo.critic={critic} with a lora section: a LoRA PPO run's critic is its own adapter and value "
                "head on the policy's frozen base; set ppo.critic=adapter (or lora: null to train every parameter)")
    return None


def _critic_path(config):
    pc = config.ppo
    separate_from_reward_model = pc.critic == "separate" and pc.critic_init == "reward_model"
    if config.algorithm == "ppo" and separate_from_reward_model and not pc.critic_path:
        return ("ppo.critic_init=reward_model needs ppo.critic_path (a reward model folder, alignax export of a "
                "reward run)")
    return None


def _reward_source(config):
    r = config.rewards
    no_verifier = r.verifier_weight == 0 and r.format_weight == 0
    if GENERATION(config) and no_verifier and not r.functions and not r.reward_models and not r.judge_model:
        return ("rewards: no reward source (rewards.verifier_weight and rewards.format_weight are 0, no "
                "rewards.functions, no rewards.reward_models, no rewards.judge_model); set one of them")
    return None


def _env_settings(config):
    env = config.env
    if env.name is None or not ONLINE(config):
        return None
    if config.algorithm == "grpo" and config.grpo.advantage == "process":
        return ("env.name is set with grpo.advantage=process: process advantages read step rewards at text "
                "delimiters, which a trajectory's observation turns break; use another grpo.advantage")
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


def _iterative_loss(config):
    if config.algorithm == "iterative_dpo" and config.dpo.loss == "kto":
        return "dpo.loss=kto does not fit algorithm iterative_dpo: each round trains on pairs (dpo, simpo, cpo or orpo)"
    if config.algorithm == "iterative_dpo" and config.rollout.num_samples < 2:
        return (f"rollout.num_samples={config.rollout.num_samples}: iterative_dpo pairs two of a prompt's samples; "
                "set rollout.num_samples >= 2")
    return None


def _dpo_variant(config):
    if config.algorithm in ("dpo", "iterative_dpo") and config.dpo.loss == "dpo" and config.dpo.variant not in DPO_VARIANTS:
        return f"dpo.variant={config.dpo.variant} is not a DPO variant; valid: {', '.join(DPO_VARIANTS)}"
    return None


def _checkpoint_keep(config):
    keep = config.checkpoint.keep
    if keep < 1:
        return (f"checkpoint.keep={keep}: it is how many of the newest step checkpoints are kept, and {keep} would "
                "delete every one; set checkpoint.keep >= 1 (or checkpoint.enabled=false to save none)")
    return None


def _remote_output_dir(config):
    if config.algorithm == "iterative_dpo" and paths.is_remote(config.output_dir):
        return (f"output_dir={config.output_dir}: iterative_dpo writes each round's pairs and exported policy as "
                "local files and reads them back as the next round's data and model; use a local output_dir")
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
    if placement.on_submesh("reward_models") and config.algorithm not in ("grpo", "ppo"):
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


# --- local files, checked at load before any model is read: model folders and data files
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("sentencepiece.bpe.model",),
                    ("vocab.json", "merges.txt"), ("vocab.txt",))
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # alignax.models.hf.read_hf_tensors


def _model_folder(config):
    """``model.name`` naming a local folder (not a registry name): the files the run reads
    from it are there (alignax.trainers.engine.setup: config.json, the safetensors weights
    unless ``model.random_init``, and the tokenizer ``AutoTokenizer`` loads)."""
    name = config.model.name
    if name in registry.MODELS or not os.path.isdir(name):
        return None  # a registry name, or no folder: the build step names it
    files = set(os.listdir(name))
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if config.model.random_init is None and not files.intersection(_WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(_WEIGHT_FILES)})")
    if not any(all(f in files for f in group) for group in _TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json; or tokenizer.model, or vocab.json + merges.txt)")
    if missing:
        return (f"model.name={name}: the model folder lacks {'; '.join(missing)}. A Hugging Face model folder "
                "holds config.json, model.safetensors and its tokenizer (save the tokenizer beside the weights: "
                "tokenizer.save_pretrained(folder); alignax export writes all three)")
    return None


def _first_record(path: str) -> tuple[str, Any]:
    """``("empty", why)``, ``("record", field names of the first record)``, or
    ``("unknown", None)`` (a type or content this cheap look does not read: the data
    pipeline reads it, and reports what is wrong with the file and line)."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty", "0 bytes"
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            if meta.num_rows == 0:
                return "empty", "a Parquet file of 0 rows"
            return "record", list(meta.schema.to_arrow_schema().names)
        if not path.endswith((".jsonl", ".json")):
            return "unknown", None
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if path.endswith(".json") and head.lstrip().startswith(b"["):
                text = (head + f.read(1 << 20)).decode("utf-8", errors="replace")
                start = text.index("[") + 1
                while start < len(text) and text[start].isspace():
                    start += 1
                if text[start:start + 1] == "]":
                    return "empty", "an empty JSON array"
                record, _ = json.JSONDecoder().raw_decode(text, start)
            else:
                f.seek(0)
                for line in f:
                    if line.strip():
                        record = json.loads(line.decode("utf-8"))
                        break
                else:
                    return "empty", "only blank lines"
    except Exception:  # noqa: BLE001 - unreadable or malformed: the pipeline reports it with its line/row
        return "unknown", None
    return ("record", list(record)) if isinstance(record, dict) else ("unknown", None)


def _fields_for(keys: Sequence[str], fmt: str, field_map: dict[str, str]) -> list[str] | None:
    """The record keys that fill format ``fmt``'s fields (alignax.data.formats), or None
    when a field the format needs is absent."""
    found = []
    for field, candidates in DEFAULT_FIELDS[fmt].items():
        candidates = (field_map[field],) if field in field_map else candidates
        key = next((k for k in candidates if k in keys), None)
        if key is not None:
            found.append(key)
        elif field not in OPTIONAL_FIELDS.get(fmt, ()):
            return None
    return found


def _data_files_of(config, prefix: str, reader: str, formats: tuple[str, ...]) -> str | None:
    section = get(config, prefix)
    if section is None or section is _MISSING:
        return None
    fmt, field_map = section.format, dict(section.field_map)
    for i, path in enumerate(section.paths):
        if is_generator_spec(path) or not os.path.isfile(path):
            continue  # a generator, a folder, or a missing file (the data pipeline names it)
        if not path.endswith(DATA_FILE_SUFFIXES):
            continue
        kind, what = _first_record(path)
        where = f"{prefix}.paths[{i}] {path}"
        if kind == "empty":
            return f"{where}: the data file is empty ({what}); it holds no records"
        if kind != "record" or fmt not in DEFAULT_FIELDS:
            continue
        keys = what
        mine = _fields_for(keys, fmt, field_map)
        others = {f: m for f in FORMATS if f != fmt and f in DEFAULT_FIELDS
                  for m in [_fields_for(keys, f, {})] if m is not None}
        reads = (f"{reader} reads {prefix}.format={fmt}" if fmt in formats else f"{prefix}.format is {fmt}")
        if others:
            other, fields = max(others.items(), key=lambda kv: len(kv[1]))
            if mine is None or len(fields) > len(mine):
                own = {k for c in DEFAULT_FIELDS[fmt].values() for k in c} | set(field_map.values())
                shown = [k for k in fields if k not in own] or fields
                fix = f"; set {prefix}.format={other}" if other in formats else ""
                return (f"{where}: its records look like format '{other}' (fields {', '.join(shown)}) but "
                        f"{reads}{fix}")
        if mine is None and section.on_bad_record == "error":
            needed = [f"{field} ({' or '.join((field_map[field],) if field in field_map else names)})"
                      for field, names in DEFAULT_FIELDS[fmt].items() if field not in OPTIONAL_FIELDS.get(fmt, ())]
            return (f"{where}: its first record has fields {', '.join(map(str, keys)) or 'none'}; {reads}, whose "
                    f"records need {', '.join(needed)} (rename a field with {prefix}.field_map)")
    return None


def _data_files(config):
    formats, by = _formats_of(config)
    return _data_files_of(config, "data", by, formats)


def _ptx_files(config):
    if config.algorithm != "ppo":
        return None
    return _data_files_of(config, "ppo.ptx_data", "PPO-ptx's SFT loss", tuple(f for f in ("sft", "text") if f in FORMATS))


def _eval_prompts_files(config):
    if not GENERATION(config):
        return None
    return _data_files_of(config, "evaluation.prompts", "an evaluation", ("prompt",))


CONSTRAINTS: tuple[Callable[[TrainConfig], str | None], ...] = (
    _data_format,
    _ptx_format,
    _eval_prompts_format,
    _dpo_variant,
    _group_size,
    _minibatches,
    _offline_micro_batches,
    _ptx_micro_batches,
    _packed_groups,
    _critic_adapter,
    _critic_path,
    _reward_source,
    _overlong_buffer,
    _env_settings,
    _pass_k_verdict,
    _iterative_loss,
    _checkpoint_keep,
    _remote_output_dir,
    _mesh_shape,
    _submesh,
    _reward_task,
    _model_folder,
    _data_files,
    _ptx_files,
    _eval_prompts_files,
)
"""Each returns the problem in words (naming its keys), or None."""


# ---------------------------------------------------------------------------- the schema
def schema_keys(cls: type = TrainConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema: leaves, and optional sections (``ppo.ptx_data``)
    with their leaves after them."""
    hints = type_hints(cls)
    for field in dataclasses.fields(cls):
        tp, key = hints[field.name], prefix + field.name
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, key + ".")
        elif inner:
            yield key
            yield from schema_keys(inner[0], key + ".")
        else:
            yield key


def _default(cls: type, field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _MISSING


def set_keys(config: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(key, value, default)`` of every key whose value differs from its dataclass default;
    a set optional section (``ppo.ptx_data``) comes before its own set keys."""
    for field in dataclasses.fields(config):
        value, key = getattr(config, field.name), prefix + field.name
        if dataclasses.is_dataclass(value):
            default = _default(type(config), field)
            if default is None:  # an optional section, set
                yield key, value, None
            yield from set_keys(value, key + ".")
            continue
        default = _default(type(config), field)
        if default is _MISSING or value != default:
            yield key, value, default


@dataclasses.dataclass(frozen=True)
class Unusable:
    """A set key that the run would ignore: the first of its rules that fails."""

    key: str
    value: Any
    default: Any
    rule: Rule


def unusable_keys(config: TrainConfig) -> list[Unusable]:
    """The set keys whose rows of :data:`KEY_RULES` do not all hold, in schema order; the
    keys under an optional section reported for a rule are not repeated for it."""
    out: list[Unusable] = []
    for key, value, default in set_keys(config):
        for r in rules_covering(key):
            if not r.when(config):
                if not any(u.rule is r and key.startswith(u.key + ".") for u in out):
                    out.append(Unusable(key, value, default, r))
                break
    return out


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
    for constraint in CONSTRAINTS:
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


__all__ = ["CONSTRAINTS", "KEY_RULES", "Rule", "problems", "schema_keys", "set_keys", "unusable_keys", "validate"]
