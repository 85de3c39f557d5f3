"""The one map of algorithms: every fact about an algorithm, in its entry.

An entry (:class:`Algorithm`) says what the ``algorithm:`` value builds and what it reads:
its family, the model kinds it holds, its builder, its own config sections, the data
formats it accepts, which frozen models it holds (a reference policy, scoring models), its
own rows of the key table and its cross-field constraints, and what the memory estimator
must count (the head of the trained model, rows per record, packed pairs, a critic).
Validation (:mod:`alignax.trainers.validation`), ``alignax estimate``
(:mod:`alignax.estimate`) and :mod:`alignax.trainers.api` ask the entry; no other module
spells an algorithm's name.

Adding an algorithm: its module (a task builder for an offline family, an
``OnlineAlgorithm`` builder for an online one), its section dataclass in
:mod:`alignax.trainers.config`, and one entry below (``docs/configuration.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from alignax import estimators, paths
from alignax.config import ALWAYS, NEVER, Above, All, AnyOf, Check, Cond, ConfigError, Given, Is, IsNot, Rule, rule, show
from alignax.data import checks as data_checks
from alignax.data.formats import FORMATS
from alignax.losses import objectives
from alignax.losses.preference import DPO_VARIANT_TABLE, F_DIVERGENCE_VARIANTS, SFT_TERM, SMOOTHED_VARIANTS
from alignax.trainers import iterative
from alignax.trainers.config import TrainConfig
from alignax.trainers.iterative import IterativeTrainer
from alignax.trainers.offline import distill, preference, prm, reward, sft
from alignax.trainers.online import grpo, ppo
from alignax.trainers.online import onpolicy_distill

Constraint = Callable[[TrainConfig], "str | None"]


def _one(_config) -> int:
    return 1


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An entry of the map.

    Fields:
      name: the ``algorithm:`` value.
      family: ``offline`` (``make`` is a task builder, ``(config, graphdef, rest) -> Task``),
        ``online`` (``make`` is an algorithm builder, ``config -> OnlineAlgorithm``) or
        ``iterative`` (``make`` is the trainer: rounds of runs, each in its own directory).
      model_kinds: the model kinds the trainer may hold; the first is the one an offline
        trainer trains (an online algorithm names its policy's kind, ``policy_kind``, and
        PPO's separate critic is a ``value`` model).
      make: the builder (above).
      sections: its own config sections (``TrainConfig`` fields), read by it alone; the first
        holds an online family's ``epochs`` and ``minibatches``.
      data_formats: ``config -> (formats of data.format it reads, what decides them)``.
      reference: when it holds a frozen reference policy; ``precomputed_reference``: when
        that reference is a table of log-probs computed before training (no model held).
      scorers: when it holds frozen scoring models of its own (beyond ``rewards:``'s).
      lora: whether a ``lora:`` section trains it.
      packs_examples: whether its loss reads packed rows (``data.packing``: several examples
        per row kept apart by segment ids; :mod:`alignax.data.example_packing`).
      rules: its rows of the key table (``alignax.config.Rule``: keys of its sections read
        under a condition).
      constraints: its cross-field checks, ``config -> problem in words | None``.
      rows_per_record: the rows one record makes in a training batch (estimator: a pair is 2).
      packs_pairs: when a preference pair may run as one packed row (estimator).
      critic / critic_on_base: when it trains a critic model of its own / that critic is an
        adapter on the policy's frozen base (estimator).
      estimate_as: the config whose training step is the run's (iterative: a round's run).
      teacher: ``config -> ModelSpec`` of the frozen model of its own that it holds in the
        reference's place (distillation's teacher; the estimator counts it at its own size).
      reference_in_update: when an online entry's reference runs inside the update's steps
        (once an epoch) instead of once in the collector (estimator: its forward's count).
      clips: when its policy loss holds the ratio to a bound, so the clip fraction it logs
        means something (``monitor.clip_fraction`` is read then only).
      trains_on_rewards: when its updates follow ``rewards:`` (online: the advantages come
        from them), so a gold scorer must not be one of them; on-policy distillation follows
        its teacher and only logs the rewards.
    """

    name: str
    family: Literal["offline", "online", "iterative"]
    model_kinds: tuple[str, ...]
    make: Callable[..., Any]
    sections: tuple[str, ...]
    data_formats: Callable[[TrainConfig], tuple[tuple[str, ...], str]]
    reference: Cond = NEVER
    precomputed_reference: Cond = NEVER
    scorers: Cond = NEVER
    lora: bool = True
    packs_examples: bool = False
    rules: tuple[Rule, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    rows_per_record: Callable[[TrainConfig], int] = _one
    packs_pairs: Cond = NEVER
    critic: Cond = NEVER
    critic_on_base: Cond = NEVER
    estimate_as: Callable[[TrainConfig], TrainConfig] | None = None
    teacher: Callable[[TrainConfig], Any] | None = None
    reference_in_update: Cond = NEVER
    clips: Cond = NEVER
    trains_on_rewards: Cond = ALWAYS

    @property
    def head(self) -> Literal["lm", "scalar"]:
        """The head of the trained model: a reward model's score head is one number per sequence."""
        return "scalar" if self.model_kinds[0] in ("reward", "value") else "lm"

    @property
    def generates(self) -> bool:
        """Whether training samples completions (online rollouts, iterative rounds' pairs)."""
        return self.family in ("online", "iterative")


def _formats(*formats: str) -> Callable[[TrainConfig], tuple[tuple[str, ...], str]]:
    chosen = tuple(f for f in formats if f in FORMATS)
    return lambda config: (chosen, f"algorithm {config.algorithm}")


# ---------------------------------------------------------------------------- the preference family

def _variants(config) -> tuple[str, ...]:
    """The names ``preference.variant`` holds: one, or a mixture's list."""
    variant = config.preference.variant
    return (variant,) if isinstance(variant, str) else tuple(variant)


def _names_variant(*names: str) -> All:
    """``preference.loss=dpo`` and ``preference.variant`` (a name or a mixture's list) names one of ``names``."""
    return All(Is("preference.loss", "dpo"),
               Check(f"preference.variant={'|'.join(names)}", lambda c: bool(set(_variants(c)) & set(names)),
                     lambda c: f"preference.variant={show(c.preference.variant)}"))


DPO = Is("preference.loss", "dpo")
MIXTURE = Check("preference.loss=dpo with a list in preference.variant",
                lambda c: c.preference.loss == "dpo" and not isinstance(c.preference.variant, str),
                lambda c: f"preference.loss={c.preference.loss}, preference.variant={show(c.preference.variant)}")

PREFERENCE_RULES: tuple[Rule, ...] = (
    rule("preference.variant", DPO),
    rule("preference.label_smoothing",
         AnyOf(_names_variant(*SMOOTHED_VARIANTS), Is("preference.loss", "simpo", "cpo"))),
    rule("preference.dpop_lambda", _names_variant("dpop")),
    rule("preference.discopop_tau", _names_variant("discopop")),
    rule("preference.loss_weights", MIXTURE, "one weight per entry of a list of variants"),
    rule(["preference.rpo_alpha", "preference.f_divergence", "preference.use_weighting", "preference.ld_alpha",
          "preference.sync_ref"], DPO),
    rule("preference.f_alpha", All(DPO, Is("preference.f_divergence", "alpha"))),
    rule("preference.sync_ref", IsNot("preference.reference", "precomputed"),
         "TR-DPO moves the reference model; a precomputed reference is a table of log-probs of the initial one"),
    rule("preference.simpo_gamma", Is("preference.loss", "simpo")),
    rule("preference.cpo_alpha", Is("preference.loss", "cpo")),
    rule(["preference.kto_desirable_weight", "preference.kto_undesirable_weight"], Is("preference.loss", "kto")),
    rule("preference.reference", preference.USES_REFERENCE, "simpo, cpo and orpo have no reference model"),
)


def _preference_formats(config):
    loss = config.preference.loss
    return (("unpaired",) if loss == "kto" else ("preference",)), f"preference.loss={loss}"


def _dpo_variant(config):
    """Every name of ``preference.variant`` is a variant (or a mixture's ``sft``), with one
    weight each, and the options it is combined with read it."""
    section = config.preference
    if section.loss != "dpo":
        return None
    names = _variants(config)
    valid = (*DPO_VARIANT_TABLE, SFT_TERM) if len(names) > 1 else tuple(DPO_VARIANT_TABLE)
    for name in names:
        if name not in valid:
            return f"preference.variant={name} is not a DPO variant; valid: {', '.join(valid)}"
    if not names:
        return f"preference.variant=[]: name a variant (one of {', '.join(DPO_VARIANT_TABLE)})"
    if section.loss_weights is not None and len(section.loss_weights) != len(names):
        return (f"preference.loss_weights={list(section.loss_weights)} has {len(section.loss_weights)} weights for "
                f"the {len(names)} entries of preference.variant={list(names)}; give one each")
    return _dpo_options(section, names)


def _dpo_options(section, names):
    others = [n for n in names if n != SFT_TERM and n not in F_DIVERGENCE_VARIANTS]
    if section.f_divergence != "reverse_kl" and others:
        return (f"preference.f_divergence={section.f_divergence} with preference.variant={', '.join(others)}: the "
                f"f-divergence maps the log-ratios of {', '.join(F_DIVERGENCE_VARIANTS)} only; use reverse_kl")
    if section.f_divergence == "alpha" and section.f_alpha == 1:
        return "preference.f_alpha=1 is the reverse KL's limit; set preference.f_divergence=reverse_kl"
    sorting = [n for n in names if n != SFT_TERM and DPO_VARIANT_TABLE[n].sorts]
    if section.use_weighting and sorting:
        return (f"preference.use_weighting with preference.variant={', '.join(sorting)}: aot sorts the pairs, so a "
                "per-pair WPO weight has no position to go to; set use_weighting: false")
    if section.ld_alpha is not None and not 0.0 <= section.ld_alpha <= 1.0:
        return f"preference.ld_alpha={section.ld_alpha} must be in [0, 1] (1: plain DPO, 0: the tail dropped)"
    return None


def _sync_ref(config):
    """TR-DPO's reference is a whole model in the train state, updated in the step."""
    if config.preference.sync_ref is None:
        return None
    if config.lora is not None:
        return ("preference.sync_ref with a lora section: the reference is the base with the adapters off, which "
                "TR-DPO cannot move; drop preference.sync_ref or train every parameter (lora: null)")
    if config.placement.reference != "device":
        return (f"preference.sync_ref with placement.reference={config.placement.reference}: TR-DPO's reference is "
                "part of the train state on the training devices; set placement.reference: device")
    return None


def _two_rows(_config) -> int:
    return 2  # a pair's chosen and rejected; KTO's record and its KL partner


PRECOMPUTED = Is("preference.reference", "precomputed")


# ---------------------------------------------------------------------------- iterative DPO
def _iterative_pairs(config):
    if config.preference.loss == "kto":
        return ("preference.loss=kto does not fit algorithm iterative_dpo: each round trains on pairs (dpo, simpo, "
                "cpo or orpo)")
    if config.rollout.num_samples < 2:
        return (f"rollout.num_samples={config.rollout.num_samples}: iterative_dpo pairs two of a prompt's samples; "
                "set rollout.num_samples >= 2")
    return None


def _local_output_dir(config):
    if paths.is_remote(config.output_dir):
        return (f"output_dir={config.output_dir}: iterative_dpo writes each round's pairs and exported policy as "
                "local files and reads them back as the next round's data and model; use a local output_dir")
    return None


def _first_round(config):
    return iterative.round_config(config, 0)


# ---------------------------------------------------------------------------- the online families
def _kl_rules(section: str, *with_the_coef: str) -> tuple[Rule, ...]:
    """The rows of the KL keys a :class:`~alignax.trainers.config.PolicyUpdateSection` shares."""
    return (rule([f"{section}.kl_kind", *with_the_coef, f"{section}.adaptive_kl"], Above(f"{section}.kl_coef", 0),
                 "kl_coef 0 drops the reference and the KL with it"),
            rule([f"{section}.kl_target", f"{section}.kl_horizon"], Is(f"{section}.adaptive_kl", True)),
            rule(f"{section}.kl_importance_weight",
                 All(Above(f"{section}.kl_coef", 0), Is(f"{section}.kl_placement", "loss")),
                 "it weights the KL term of the loss; a KL in the reward is data, from the sampling policy's "
                 "own log-probs"))


GRPO_RULES: tuple[Rule, ...] = (
    *_kl_rules("grpo"),
    rule("grpo.unbiased_std", Is("grpo.advantage", "grpo", "process", "grpo_passk", "gdpo"),
         "only these divide by a std"),
    rule("grpo.reinforce_baseline", Is("grpo.advantage", "reinforce_pp")),
    rule("grpo.scale_rewards", Is("grpo.advantage", "grpo"), "it picks grpo advantages' std"),
    rule("grpo.gpg_valid", Is("grpo.advantage", "gpg"), "it counts gpg's valid samples"),
    # each objective's own keys, from its registry entry (alignax.losses.objectives)
    *(rule(f"grpo.{key}", Is("grpo.policy_loss", *objectives.readers(key)), "only these objectives read it")
      for key in objectives.keys()),
    rule("grpo.kl_placement", All(Above("grpo.kl_coef", 0), IsNot("grpo.advantage", "process")),
         "process advantages read the step rewards only, never the sequence reward a KL is subtracted from"),
    rule("grpo.max_refills", Is("grpo.dynamic_sampling", True)),
    rule(["grpo.entropy_coef_delta", "grpo.entropy_coef_max"], Given("grpo.target_entropy"),
         "they step and bound the adaptive entropy coefficient"),
    rule(["grpo.step_delimiter", "grpo.process_reward", "grpo.process_reward_model"], Is("grpo.advantage", "process")),
    rule("grpo.process_reward", Is("grpo.process_reward_model", None), "a trained PRM gives the step rewards"),
    rule("grpo.process_reward_aggregation", Given("grpo.process_reward_model"), "it reduces the PRM's step scores"),
    rule("grpo.reward_aggregation", Is("grpo.advantage", "grpo"),
         "normalize_then_sum is GDPO's estimator: TRL's spelling of grpo.advantage=gdpo"),
)


def _policy_objective(config):
    """``grpo.policy_loss`` names a registered objective, and the keys it cannot do without are set."""
    name = config.grpo.policy_loss
    if name not in objectives.OBJECTIVES:
        return f"grpo.policy_loss={name} is not a policy objective; valid: {', '.join(objectives.OBJECTIVES)}"
    missing = [k for k in objectives.OBJECTIVES[name].required if getattr(config.grpo, k) is None]
    if missing:
        return (f"grpo.policy_loss={name} needs {', '.join(f'grpo.{k}' for k in missing)} (no paper default "
                f"carries over; e.g. grpo.{missing[0]}: 0.1)")
    return _objective_values(config)


def _objective_values(config):
    """The objective's keys that are set hold values its loss accepts. Each loss checks its
    hyper-parameters before it computes, so tracing it on a one-token batch (no compute)
    asks it at load rather than at the first update."""
    entry = objectives.OBJECTIVES[config.grpo.policy_loss]
    keywords = grpo.objective_keywords(config.grpo, config.grpo.policy_loss)
    if not keywords:
        return None
    token = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    rng = {"key": jax.random.key(0)} if entry.rng else {}
    try:
        jax.eval_shape(functools.partial(entry.loss, **keywords, **rng), token, token, token, token)
    except ValueError as error:
        return f"grpo.policy_loss={config.grpo.policy_loss}: grpo.{error}"
    return None


def _group_size(config):
    """``grpo.advantage`` names a registered estimator, and the rollout has what it needs
    (samples per prompt; the reward components of GDPO)."""
    if config.grpo.advantage not in estimators.ESTIMATORS:
        return (f"grpo.advantage={config.grpo.advantage} is not an advantage estimator; valid: "
                f"{', '.join(estimators.ESTIMATORS)}")
    entry = estimators.estimator(estimators.effective_name(config.grpo))
    problem = _component_estimator(config) if entry.reward_components else None
    if problem:
        return problem
    needs = entry.min_group_size
    if config.rollout.num_samples < needs:
        single = [e.name for e in estimators.ENTRIES if e.min_group_size == 1]
        return (f"rollout.num_samples={config.rollout.num_samples}: grpo.advantage={config.grpo.advantage} compares "
                f"the samples of a prompt; set rollout.num_samples >= {needs} (or grpo.advantage="
                f"{' or '.join(single)})")
    return None


def _component_estimator(config):
    """An estimator that reads the reward components apart (GDPO) never reads the total
    reward: nothing that acts on the total may be set."""
    gc, name = config.grpo, estimators.effective_name(config.grpo)
    if config.rewards.clip:
        return (f"rewards.clip={list(config.rewards.clip)} clips the total reward, which grpo.advantage={name} never "
                "reads (it normalises each reward component); set rewards.clip: null")
    if gc.kl_placement == "reward" and gc.kl_coef > 0:
        return (f"grpo.kl_placement=reward subtracts the KL from the total reward, which grpo.advantage={name} never "
                "reads (it normalises each reward component); set grpo.kl_placement: loss")
    if gc.scale_rewards != "group":
        return (f"grpo.scale_rewards={gc.scale_rewards} picks grpo advantages' std; grpo.reward_aggregation="
                "normalize_then_sum normalises each component by its group's own; remove grpo.scale_rewards")
    return None


def _process_without_env(config):
    if config.env.name is not None and config.grpo.advantage == "process":
        return ("env.name is set with grpo.advantage=process: process advantages read step rewards at text "
                "delimiters, which a trajectory's observation turns break; use another grpo.advantage")
    return None


_PTX_FORMATS = tuple(f for f in ("sft", "text") if f in FORMATS)

PPO_RULES: tuple[Rule, ...] = (
    *_kl_rules("ppo", "ppo.kl_placement"),
    rule("ppo.critic_init", Is("ppo.critic", "separate"), "a shared critic is a value head on the policy"),
    rule("ppo.critic_path", All(Is("ppo.critic", "separate"), Is("ppo.critic_init", "reward_model"))),
    rule("ppo.target_kl", Above("ppo.epochs", 1), "it stops the remaining epochs of a rollout"),
    rule("ppo.ptx_coef", Given("ppo.ptx_data"), "PPO-ptx's SFT loss needs its data"),
    rule("ppo.ptx_data", Above("ppo.ptx_coef", 0), "the ptx data feed PPO-ptx's SFT loss at weight ppo.ptx_coef"),
    *data_checks.key_rules("ppo.ptx_data"),
    rule("ppo.ptx_data.eval_fraction", NEVER, "PPO-ptx reads its data's train split only"),
)


def _ptx_data(config):
    """PPO-ptx's data: its format, its batch against the micro-batches, its files."""
    ptx, accum = config.ppo.ptx_data, config.train.grad_accum_steps
    if ptx is None:
        return None
    if ptx.format not in _PTX_FORMATS:
        return (f"ppo.ptx_data.format={ptx.format}: PPO-ptx's SFT loss reads ppo.ptx_data.format="
                f"{' or '.join(_PTX_FORMATS)}")
    if ptx.batch_size % accum:
        return f"train.grad_accum_steps={accum} does not divide ppo.ptx_data.batch_size={ptx.batch_size}"
    return data_checks.data_file_problem(ptx, "ppo.ptx_data", "PPO-ptx's SFT loss", _PTX_FORMATS)


def _critic(config):
    """``ppo.critic=adapter`` is a LoRA run's critic, and a LoRA PPO run's only critic; a
    critic from a reward model needs its folder."""
    pc = config.ppo
    if pc.critic == "adapter" and config.lora is None:
        return ("ppo.critic=adapter is an adapter and value head on the policy's frozen base: it needs a lora "
                "section (lora.rank, ...); without LoRA set ppo.critic=separate or shared")
    if pc.critic != "adapter" and config.lora is not None:
        return (f"ppo.critic={pc.critic} with a lora section: a LoRA PPO run's critic is its own adapter and value "
                "head on the policy's frozen base; set ppo.critic=adapter (or lora: null to train every parameter)")
    if pc.critic == "separate" and pc.critic_init == "reward_model" and not pc.critic_path:
        return ("ppo.critic_init=reward_model needs ppo.critic_path (a reward model folder, alignax export of a "
                "reward run)")
    return None


# ---------------------------------------------------------------------------- SFT
_PACKED_AGGREGATIONS = ("token-mean", "token-sum")


def _sft_packing(config):
    """Packed rows: a token-level loss (a row is not a sequence) and an attention kernel that
    takes segment ids."""
    if not config.data.packing:
        return None
    if config.sft.aggregation not in _PACKED_AGGREGATIONS:
        return (f"sft.aggregation={config.sft.aggregation} with data.packing: a packed row holds several sequences, "
                f"so only a token-level aggregation ({' or '.join(_PACKED_AGGREGATIONS)}) is the unpacked loss; "
                "set data.packing: false for a per-sequence mean")
    if config.model.attention != "xla":  # auto is a fused kernel on a GPU or TPU
        return (f"model.attention={config.model.attention} with data.packing: the packed rows need the segment-id "
                "mask of model.attention=xla (the fused kernels see causal + real keys only)")
    return None


# ---------------------------------------------------------------------------- distillation
DISTILL_RULES: tuple[Rule, ...] = (
    rule("distill.beta", All(Is("distill.divergence", "jsd"), Is("distill.top_k", None)),
         "beta is the JSD's; top-k teacher logits give a forward KL"),
    rule("distill.divergence", Is("distill.top_k", None), "top-k teacher logits give a forward KL"),
    rule("distill.teacher.logprob_chunk_size", NEVER,
         "distillation compares whole next-token distributions: the logits are never chunked"),
    rule(["distill.teacher.param_dtype", "distill.teacher.dtype"], NEVER,
         "the teacher is a frozen model: precision.frozen_dtype sets its dtype"),
    rule("distill.teacher.seed", Given("distill.teacher.random_init"), "only a random teacher is seeded"),
    rule("distill.lmbda", Is("algorithm", "gkd"), "only GKD trains on the student's own samples"),
    rule("distill.teacher_logits", Is("algorithm", "distill"), "GKD's teacher scores the student's samples live"),
    rule(["distill.divergence", "distill.beta", "distill.temperature", "distill.top_k", "distill.aggregation"],
         Is("algorithm", "distill", "gkd"),
         "onpolicy_distill's loss is the reverse KL at rollout.temperature (onpolicy_distill.estimator, "
         "onpolicy_distill.aggregation)"),
)


def _teacher_named(config):
    if config.distill.teacher is None:
        return (f"algorithm {config.algorithm} needs distill.teacher (the frozen teacher model: distill.teacher.name, "
                "a folder or registry name)")
    return None


def _teacher(config):
    """The teacher is named, and a precomputed or sub-mesh teacher hands over its top-k."""
    section = config.distill
    if section.teacher is None:
        return _teacher_named(config)
    if section.top_k is None and section.teacher_logits == "precomputed":
        return ("distill.teacher_logits=precomputed stores the teacher's top-k log-probs of every record; set "
                "distill.top_k (e.g. 32)")
    if section.top_k is None and config.placement.on_submesh("reference"):
        return ("placement.reference=submesh sends the teacher's top-k log-probs back to the training devices; set "
                "distill.top_k (e.g. 32)")
    return None


def _on_policy_teacher(config):
    """GKD's teacher scores the student's samples inside the step: it runs beside the student."""
    if config.placement.on_submesh("reference"):
        return ("placement.reference=submesh with algorithm gkd: the teacher scores the student's samples inside the "
                "step; place it on device or host")
    return None


def _exact_teacher_beside_the_student(config):
    """The exact reverse KL reads the teacher's whole logits inside the update step."""
    if config.onpolicy_distill.estimator == "exact" and config.placement.on_submesh("reference"):
        return ("placement.reference=submesh with onpolicy_distill.estimator=exact: the exact reverse KL reads the "
                "teacher's whole logits inside the update step; place the teacher on device or host, or set "
                "onpolicy_distill.estimator=sampled (one teacher log-prob a token, which the sub-mesh sends back)")
    return None


def _exact_has_no_ratio(config):
    """The exact reverse KL has no policy ratio for rollout.tis_cap to truncate, nor tokens
    for rollout.rejection (or rollout.rejection_divergences) to drop from a policy loss."""
    if config.onpolicy_distill.estimator != "exact":
        return None
    for key in ("tis_cap", "rejection", "rejection_divergences"):
        value = getattr(config.rollout, key)
        if value is not None and value != {}:
            return (f"rollout.{key}={value} with onpolicy_distill.estimator=exact: the exact reverse KL is no "
                    "importance-weighted policy loss, so the sampler correction has nothing to act on; remove "
                    f"rollout.{key} or set onpolicy_distill.estimator=sampled (PPO-clip on the sampled-token estimate)")
    return None


def _teacher_spec(config):
    return config.distill.teacher


DISTILL_PRECOMPUTED = Is("distill.teacher_logits", "precomputed")


# ---------------------------------------------------------------------------- the map
ENTRIES: tuple[Algorithm, ...] = (
    Algorithm("sft", "offline", ("causal_lm",), sft.make_task, ("sft",), _formats("sft", "text"),
              packs_examples=True, constraints=(_sft_packing,)),
    Algorithm("reward", "offline", ("reward",), reward.make_task, ("reward_model",), _formats("preference"),
              rows_per_record=_two_rows),
    Algorithm("prm", "offline", ("reward",), prm.make_task, ("prm",), _formats("steps"), lora=False),
    Algorithm("dpo", "offline", ("causal_lm",), preference.make_task, ("preference",), _preference_formats,
              reference=preference.USES_REFERENCE, precomputed_reference=PRECOMPUTED, rules=PREFERENCE_RULES,
              constraints=(_dpo_variant, _sync_ref), rows_per_record=_two_rows,
              packs_pairs=IsNot("preference.loss", "kto")),
    Algorithm("iterative_dpo", "iterative", ("causal_lm",), IterativeTrainer, ("iterative", "preference"),
              _formats("prompt"), reference=preference.USES_REFERENCE, precomputed_reference=PRECOMPUTED,
              lora=False, rules=PREFERENCE_RULES,
              constraints=(_dpo_variant, _sync_ref, _iterative_pairs, _local_output_dir),
              estimate_as=_first_round),
    Algorithm("grpo", "online", ("causal_lm",), grpo.build_algorithm, ("grpo",), _formats("prompt"),
              reference=Above("grpo.kl_coef", 0), scorers=Given("grpo.process_reward_model"), rules=GRPO_RULES,
              constraints=(_policy_objective, _group_size, _process_without_env),
              clips=Is("grpo.policy_loss", *objectives.clipping())),
    Algorithm("ppo", "online", ("causal_lm", "policy_value", "value"), ppo.build_algorithm, ("ppo",),
              _formats("prompt"), reference=Above("ppo.kl_coef", 0), rules=PPO_RULES,
              constraints=(_ptx_data, _critic), critic=Is("ppo.critic", "separate", "adapter"),
              critic_on_base=Is("ppo.critic", "adapter"), clips=ALWAYS),
    Algorithm("distill", "offline", ("causal_lm",), distill.make_task, ("distill",), _formats("sft", "text"),
              reference=ALWAYS, precomputed_reference=DISTILL_PRECOMPUTED, rules=DISTILL_RULES,
              constraints=(_teacher,), teacher=_teacher_spec),
    Algorithm("gkd", "offline", ("causal_lm",), distill.make_gkd_task, ("distill",), _formats("sft"),
              reference=ALWAYS, rules=DISTILL_RULES,
              constraints=(_teacher, _on_policy_teacher), teacher=_teacher_spec),
    Algorithm("onpolicy_distill", "online", ("causal_lm",), onpolicy_distill.build_algorithm,
              ("onpolicy_distill", "distill"), _formats("prompt"), reference=ALWAYS, rules=DISTILL_RULES,
              constraints=(_teacher_named, _exact_teacher_beside_the_student, _exact_has_no_ratio),
              teacher=_teacher_spec, reference_in_update=Is("onpolicy_distill.estimator", "exact"),
              clips=Is("onpolicy_distill.estimator", "sampled"), trains_on_rewards=NEVER),
)

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in ENTRIES}


# Names a TRL user reaches for (TRL has a trainer per loss): ``algorithm: kto`` is the dpo
# entry with ``preference.loss: kto``. Expanded when the config loads
# (:func:`expand_alias`), so the run, its config.yaml and its checkpoints are the dpo
# entry's and a recipe may use either spelling.
ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "kto": ("dpo", {"preference.loss": "kto"}),
    "simpo": ("dpo", {"preference.loss": "simpo"}),
    "cpo": ("dpo", {"preference.loss": "cpo"}),
    "orpo": ("dpo", {"preference.loss": "orpo"}),
    "ipo": ("dpo", {"preference.loss": "dpo", "preference.variant": "ipo"}),
}


def expand_alias(raw: dict[str, Any]) -> dict[str, Any]:
    """A raw config whose ``algorithm`` is an alias (:data:`ALIASES`), as the entry and keys it
    stands for; a key the recipe sets to another value is an error naming both."""
    name = raw.get("algorithm")
    if not isinstance(name, str) or name not in ALIASES:
        return raw
    target, keys = ALIASES[name]
    out = {**raw, "algorithm": target}
    for dotted, value in keys.items():
        section, key = dotted.split(".")
        current = out.get(section) or {}
        if not isinstance(current, dict):
            return out  # a section that is not a mapping: the schema names it
        if current.get(key, value) != value:
            raise ConfigError(f"algorithm: {name} is algorithm: {target} with {dotted}: {value}; the recipe sets "
                              f"{dotted}: {current[key]} (drop it, or write algorithm: {target})")
        out[section] = {**current, key: value}
    return out


def algorithm(name: str) -> Algorithm:
    """The entry of ``name``; an unknown name is an error listing the valid ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def named(*names: str) -> Is:
    """``algorithm`` is one of ``names`` (a condition of the key table)."""
    return Is("algorithm", *names)


def where(test: Callable[[Algorithm], bool]) -> Is:
    """``algorithm`` is one whose entry passes ``test``."""
    return named(*(a.name for a in ENTRIES if test(a)))


def except_where(test: Callable[[Algorithm], bool]) -> IsNot:
    """``algorithm`` is none of those whose entry passes ``test``."""
    return IsNot("algorithm", *(a.name for a in ENTRIES if test(a)))
