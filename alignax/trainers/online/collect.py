"""Collect: prompts -> one typed :class:`RolloutBatch` (samples, masks, behaviour and
reference log-probs, rewards, advantages, the policy version that sampled them).

:meth:`Collector.collect` runs the same straight line for every algorithm:

1. sample ``G`` completions for each of ``B`` prompts and score them
   (:func:`sample_groups`: under DAPO's dynamic sampling, refill until enough groups have
   varying rewards);
2. the per-token quantities under the current policy (:meth:`Collector.token_quantities`):
   old log-probs (recomputed by a forward pass, or the sampler's), reference log-probs,
   the critic's values. In single-update mode (:func:`single_update`) the separate
   forward pass is skipped: the update's own pass is the rollout's policy; likewise the
   reference's when the update's loss runs it (on-policy distillation's exact estimator);
3. the sequence rewards (less the KL where the algorithm's
   :class:`~alignax.trainers.online.algorithm.KLSetup` places it), ReMax's greedy baseline
   (:func:`greedy_baseline`) and process step rewards (:func:`step_rewards`), and the
   algorithm's advantages.

What an algorithm gathers is read from its bundle by those functions; the collector
itself has no branch over an algorithm's flags. The policy version of a batch is the
number of rollouts whose updates the sampling weights had seen (``state.extra["rollouts"]``).

Pricing also measures how far the learner's recomputed log-probs are from the sampler's
(:mod:`alignax.trainers.online.agreement`; in single-update mode after the update, from
its forward pass: :meth:`Collector.agreement_after_update`) and stops the run past
``rollout.max_logprob_gap``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from alignax.losses.policy import sampler_correction
from alignax.parallel.multihost import allgather_rows
from alignax.rewards.process import ProcessRewardModel, process_step_rewards, step_boundaries
from alignax.rewards.verifiers import with_task
from alignax.sampling.scored import Groups
from alignax.trainers.config import TrainConfig
from alignax.trainers.online.actors import Actors
from alignax.trainers.online.agreement import Agreement
from alignax.trainers.online.algorithm import AdvantageInputs, OnlineAlgorithm
from alignax.trainers.online.grpo import group_reward_std, select_informative_groups
from alignax.trainers.online.rollout import Rollout, RowLayout

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One rollout, ready for the update.

    ``groups``: this process's samples on the host (tokens, rewards and their components);
    ``rollout``: what the update reads, on device (``[R, P + N]`` sequences, ``[R, N]``
    per-token arrays); ``inputs``: what the advantages were computed from; ``rewards``
    ``[R_local]``: the sequence rewards the advantages saw (after a ``sequence_reward``
    KL); ``response_mask [R, N]``: the policy's own tokens; ``recomputed``/``entropy``
    ``[R, N]``: the policy's log-probs and entropy from the separate forward pass (``None``
    in single-update mode: the update supplies them); ``policy_version``: rollouts the
    sampling weights had been updated on; ``figures``: generation, refill and step-reward
    figures, and ``perf/logprob_s``; ``rollout_index``: the rollout it is (the learner's
    version when it is used; ``rollout_index - policy_version`` is its staleness).
    """

    groups: Groups
    rollout: Rollout
    inputs: AdvantageInputs
    rewards: np.ndarray
    response_mask: Array
    recomputed: Array | None
    entropy: Array | None
    policy_version: int
    rollout_index: int
    figures: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Sampled:
    """The sampler's half of a rollout (:meth:`Collector.sample`), on the host: ``groups``
    (``R_local`` scored rows), ``baseline [R_local]`` float32 (ReMax's greedy reward, else
    zeros), the generation ``figures``, the rollout it is for (``rollout_index``) and the
    policy ``version`` whose weights sampled it (``rollout_index - version``: its staleness)."""

    groups: Groups
    baseline: np.ndarray
    figures: dict[str, float]
    rollout_index: int
    version: int


def single_update(config: TrainConfig, algorithm: OnlineAlgorithm) -> bool:
    """Whether the rollout's one update supplies the old log-probs: exactly one update per
    rollout and nothing before it reads the policy's log-probs (no critic, no KL in the
    reward computed from recomputed log-probs). Its forward pass is then the policy the
    rollout came from, so the old log-probs are its log-probs with the gradient stopped
    (ratio exactly 1, as TRL and Tunix do)."""
    kl = algorithm.kl
    reads_policy = algorithm.critic is not None or (
        kl.placement in ("sequence_reward", "token_reward") and kl.uses_reference
        and config.rollout.old_logps == "recompute")
    return algorithm.epochs * algorithm.minibatches == 1 and not reads_policy


def generation_figures(seconds: float, tokens: int) -> dict[str, float]:
    return {"perf/generation_s": seconds, "perf/generation_tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def sample_groups(algorithm: OnlineAlgorithm, sampler, sampling_state, prompt_batch: Mapping[str, Any],
                  batches: Iterator, key: Array, layout: RowLayout) -> tuple[Groups, dict[str, float]]:
    """This step's scored groups and generation figures; under DAPO's dynamic sampling
    (``algorithm.dynamic_sampling_refills``) more prompt batches from ``batches`` until
    every process holds its share of groups whose rewards vary."""
    groups, gen_s, gen_tokens = sampler.sample(sampling_state, prompt_batch, jax.random.fold_in(key, 0))
    max_refills = algorithm.dynamic_sampling_refills
    if max_refills is None:
        return groups, generation_figures(gen_s, gen_tokens)
    G = layout.group_size
    parts = [groups]
    informative = int(np.sum(group_reward_std(groups.rewards, G) > 0))
    refills = 0
    # sampling is a collective: the processes refill together
    while refills < max_refills and not np.all(allgather_rows(np.array([informative >= layout.local_prompts]))):
        refills += 1
        extra, s, t = sampler.sample(sampling_state, next(batches), jax.random.fold_in(key, refills))
        parts.append(extra)
        gen_s, gen_tokens = gen_s + s, gen_tokens + t
        informative += int(np.sum(group_reward_std(extra.rewards, G) > 0))
    groups, _ = select_informative_groups(parts, num_groups=layout.local_prompts, group_size=G)
    figures = generation_figures(gen_s, gen_tokens)
    figures["groups/refills"] = float(refills)
    figures["groups/sampled"] = float(sum(p.size for p in parts) // G * jax.process_count())
    return groups, figures


def greedy_baseline(algorithm: OnlineAlgorithm, actors: Actors, sampling_state, groups: Groups, layout: RowLayout,
                    figures: dict[str, float]) -> np.ndarray:
    """``[R_local]`` float32: ReMax's baseline (``algorithm.greedy_baseline``), the reward of
    each prompt's greedy completion repeated over its group; zeros for other algorithms."""
    if not algorithm.greedy_baseline:
        return np.zeros(layout.local_rows, np.float32)
    G = layout.group_size
    prompts = {"prompt_tokens": groups.prompt_tokens[::G], "prompt_attention_mask": groups.prompt_mask[::G],
               "references": groups.references[::G]}
    greedy, _, _ = actors.sampler.sample(sampling_state, prompts, jax.random.key(0), config=actors.greedy)
    figures["reward/greedy_baseline"] = float(np.mean(allgather_rows(greedy.rewards)))
    return np.repeat(greedy.rewards, G).astype(np.float32)


def step_rewards(algorithm: OnlineAlgorithm, tokenizer, groups: Groups, task: str | None,
                 figures: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """``(step rewards, step-end mask)``, each ``[R_local, N]`` float32: process rewards
    (``algorithm.process_reward``: a function of the steps' texts or a trained PRM) on the
    last token of each step; zeros for algorithms without them."""
    zeros = np.zeros(groups.tokens.shape, np.float32)
    if algorithm.process_reward is None:
        return zeros, zeros
    step_mask, texts = step_boundaries(tokenizer, groups.tokens, groups.response_mask, algorithm.step_delimiter)
    if isinstance(algorithm.process_reward, ProcessRewardModel):
        rewards = algorithm.process_reward.step_rewards(groups, step_mask)
    else:
        rewards = process_step_rewards(algorithm.process_reward, step_mask, texts, with_task(groups.references, task))
    counts = allgather_rows(np.array([[step_mask.sum(), groups.size]], np.float64)).sum(axis=0)
    figures["process/steps_per_completion"] = float(counts[0] / max(counts[1], 1))
    return rewards, step_mask.astype(np.float32)


def reward_components(groups: Groups, weights: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """``(components [R_local, K], weights [K])`` float32: each weighted component of
    ``groups`` that has a weight in ``weights``, divided by it (a zero weight's column is 0),
    in ``weights``' order."""
    names = [name for name in weights if name in groups.components]
    w = np.array([weights[name] for name in names], np.float32)
    scored = np.stack([groups.components[name] for name in names], axis=1).astype(np.float32)
    unweighted = np.divide(scored, w, out=np.zeros_like(scored), where=w != 0)
    return unweighted, w


class Collector:
    """Prompts -> :class:`RolloutBatch` for one algorithm on one set of actors."""

    def __init__(self, config: TrainConfig, algorithm: OnlineAlgorithm, actors: Actors, layout: RowLayout, *,
                 single_pass: bool):
        self.config, self.algorithm, self.actors, self.layout = config, algorithm, actors, layout
        self.single_pass = single_pass  # see single_update
        self.advantages = jax.jit(algorithm.advantages)
        self.agreement = Agreement(config)  # sampler/learner log-prob gap, rollout.max_logprob_gap

    def rollout_key(self, state) -> tuple[int, Array]:
        """``(rollout index, its key)``: a rollout's randomness comes from the seed and its
        index, so a resumed run repeats the same rollouts."""
        rollout_index = int(jax.device_get(state.extra["rollouts"]))
        return rollout_index, jax.random.fold_in(jax.random.key(self.config.train.seed), rollout_index)

    def collect(self, state, frozen, prompt_batch: Mapping[str, Any], batches: Iterator) -> RolloutBatch:
        """Sample, score and price one rollout from the policy in ``state`` (see the module docstring)."""
        rollout_index, _ = self.rollout_key(state)
        sampling_state = self.actors.sampling_state(state.params)  # merged once a rollout (lora.merge_for_sampling)
        sampled = self.sample(sampling_state, prompt_batch, batches, rollout_index=rollout_index,
                              version=rollout_index)
        del sampling_state  # the merged weights (lora.merge_for_sampling) are not needed past sampling
        return self.price(state, frozen, sampled)

    def sample(self, sampling_state, prompt_batch: Mapping[str, Any], batches: Iterator, *, rollout_index: int,
               version: int) -> Sampled:
        """The sampler's half of a rollout: rollout ``rollout_index``'s groups generated and
        scored from ``sampling_state`` (the weights of policy ``version``), and ReMax's greedy
        baseline. Reads no train state: an asynchronous schedule runs it on another thread."""
        key = jax.random.fold_in(jax.random.key(self.config.train.seed), rollout_index)
        groups, figures = sample_groups(self.algorithm, self.actors.sampler, sampling_state, prompt_batch, batches,
                                        key, self.layout)
        baseline = greedy_baseline(self.algorithm, self.actors, sampling_state, groups, self.layout, figures)
        return Sampled(groups=groups, baseline=baseline, figures=figures, rollout_index=rollout_index,
                       version=version)

    def price(self, state, frozen, sampled: Sampled) -> RolloutBatch:
        """The learner's half: per-token quantities under the policy in ``state``, the
        sequence rewards (less a reward-side KL), step rewards and advantages of ``sampled``."""
        algo, actors, layout, groups = self.algorithm, self.actors, self.layout, sampled.groups
        figures = dict(sampled.figures)
        t_fwd = time.perf_counter()
        tokens = self.token_quantities(state, frozen, groups)
        kl_coef = jnp.array(state.extra["kl_coef"].coef)  # a copy: the update donates the state
        rewards = algo.kl.sequence_rewards(groups.rewards.astype(np.float32), tokens["old_logps"],
                                           tokens["ref_logps"], tokens["response_mask"], kl_coef)
        steps, step_mask = step_rewards(algo, actors.tokenizer, groups, self.config.rewards.task, figures)
        # In single-update mode nothing here reads the policy's log-probs (that is what the
        # mode requires), so the sampler's stand in for the inputs' old log-probs.
        old_logps = tokens["old_logps"]
        inputs = AdvantageInputs(
            rewards=actors.place(rewards), loss_mask=tokens["loss_mask"], group_ids=actors.place(layout.group_ids()),
            old_logps=tokens["sampler_logps"] if old_logps is None else old_logps, ref_logps=tokens["ref_logps"],
            old_values=tokens["old_values"], kl_coef=kl_coef, baseline=actors.place(sampled.baseline),
            step_rewards=actors.place(steps), step_mask=actors.place(step_mask),
            **self.estimator_extras(state, groups, tokens),
        )
        advantages, returns = self.advantages(inputs)
        rollout = Rollout(tokens=tokens["tokens"], positions=tokens["positions"], attention_mask=tokens["attention"],
                          loss_mask=tokens["loss_mask"], sampler_logps=tokens["sampler_logps"], old_logps=old_logps,
                          ref_logps=tokens["ref_logps"], old_values=tokens["old_values"], advantages=advantages,
                          returns=returns)
        jax.block_until_ready(rollout)  # so perf/logprob_s times the forward passes, not their dispatch
        figures["perf/logprob_s"] = time.perf_counter() - t_fwd
        if tokens["recomputed"] is not None:  # else the update's pass recomputes them: agreement_after_update
            figures.update(self.agreement.measure(tokens["sampler_logps"], tokens["recomputed"],
                                                  tokens["response_mask"], rollout_index=sampled.rollout_index,
                                                  policy_version=sampled.version))
        return RolloutBatch(groups=groups, rollout=rollout, inputs=inputs, rewards=rewards,
                            response_mask=tokens["response_mask"], recomputed=tokens["recomputed"],
                            entropy=tokens["entropy"], policy_version=sampled.version,
                            rollout_index=sampled.rollout_index, figures=figures)

    def estimator_extras(self, state, groups: Groups, tokens: Mapping[str, Any]) -> dict[str, Array]:
        """What the algorithm's estimator reads beyond the total reward (its flags): each
        ``rewards:`` component before its weight ``[R, K]`` and the weights ``[K]``
        (GDPO), and ``sum_v pi(v)^2`` with the sampled token's log-prob ``[R, N]`` (the optimal
        token baseline; one more forward pass), both of the learner's policy in ``state``, with
        the rollout correction's weights of its ``pi_old / pi_sampler`` under ``rollout.tis_cap``
        and recomputed old log-probs (``is_weights``, which the baseline squares, as verl's)."""
        extras: dict[str, Array] = {}
        if self.algorithm.reward_components:
            components, weights = reward_components(groups, self.config.rewards.component_weights())
            extras.update(reward_components=self.actors.place(components), reward_weights=jnp.asarray(weights))
        if self.algorithm.token_stats:
            placed = (tokens["tokens"], tokens["positions"], tokens["attention"])
            extras["stat_logps"], extras["sum_pi_squared"] = self.actors.token_statistics(
                self.actors.whole_policy(state.params), *placed)
            if self.config.rollout.tis_cap is not None and self.config.rollout.old_logps == "recompute":
                extras["is_weights"] = self.correction_weights(extras["stat_logps"], tokens["sampler_logps"],
                                                               tokens["loss_mask"])
        return extras

    @functools.cached_property
    def correction_weights(self):
        """A jitted ``(pi_old log-probs, sampler log-probs, loss mask) -> [R, N]``: the rollout
        correction's weight of each token (``rollout.tis_cap``, ``tis_level``, ``tis_lower``,
        ``tis_batch_normalize`` over the whole rollout), verl's decoupled ``rollout_is_weights``
        that its optimal token baseline squares."""
        rc = self.config.rollout

        def weights(old_logps, sampler_logps, loss_mask):
            return sampler_correction(old_logps - sampler_logps, loss_mask, tis_cap=rc.tis_cap, tis_level=rc.tis_level,
                                      tis_lower=rc.tis_lower, batch_normalize=rc.tis_batch_normalize).weight

        return jax.jit(weights)

    def agreement_after_update(self, batch: RolloutBatch, recomputed: Array) -> dict[str, float]:
        """Single-update mode's agreement figures: the update's own forward pass (``recomputed``
        ``[R, N]``, the pre-update weights) was the learner's recomputation. A gap past the
        bound raises here, after that one update; the loop saves no state it made."""
        if batch.recomputed is not None:  # measured in price, before the update
            return {}
        return self.agreement.measure(batch.rollout.sampler_logps, recomputed, batch.response_mask,
                                      rollout_index=batch.rollout_index, policy_version=batch.policy_version)

    def token_quantities(self, state, frozen, groups: Groups) -> dict[str, Array | None]:
        """The rollout's sequences and per-token arrays on the training mesh: ``tokens``,
        ``positions``, ``attention`` ``[R, P + N]``; ``response_mask`` (the policy's tokens),
        ``loss_mask`` (less observation tokens and, under ``rewards.mask_truncated``,
        truncated rows), ``sampler_logps``, ``old_logps``, ``recomputed``, ``entropy``,
        ``ref_logps`` (``None`` without a reference, or when the update runs it:
        ``algorithm.reference_in_update``) and ``old_values``, each ``[R, N]``."""
        actors, rc = self.actors, self.config.rollout
        sequences = groups.full_sequences()
        placed = tuple(actors.place(a) for a in sequences)
        actions = groups.actions().astype(np.float32)  # the policy's tokens (model turns)
        sampler_logps = actors.place(groups.sampler_logps)
        recomputed = entropy = shared_values = None  # single-update mode: the update returns them
        if not self.single_pass:
            recomputed, entropy, shared_values = actors.forward(actors.whole_policy(state.params), *placed)
        if actors.separate_critic:
            old_values = actors.values(actors.whole_critic(state.params), *placed)
        elif shared_values is not None:
            old_values = shared_values
        else:
            old_values = jnp.zeros_like(sampler_logps)
        loss_mask = actions  # observation tokens of a trajectory get no loss
        if self.config.rewards.mask_truncated:
            loss_mask = loss_mask * groups.stopped[:, None].astype(np.float32)
        # no reference model (a zero fixed KL coefficient): no reference log-probs, no KL figures;
        # a loss that runs the frozen model itself hands its log-probs back from the update
        priced = self.algorithm.kl.uses_reference and not self.algorithm.reference_in_update
        ref_logps = actors.reference_logps(frozen, sequences, placed) if priced else None
        return dict(tokens=placed[0], positions=placed[1], attention=placed[2], response_mask=actors.place(actions),
                    loss_mask=actors.place(loss_mask), sampler_logps=sampler_logps,
                    old_logps=sampler_logps if rc.old_logps == "sampler" else recomputed, recomputed=recomputed,
                    entropy=entropy, ref_logps=ref_logps, old_values=old_values)
