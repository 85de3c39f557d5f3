"""Rollouts for online RL: sample groups with the on-device sampler, decode, score, and
assemble the fixed-shape batch the update consumes.

Shapes: ``B`` prompts per rollout (``data.batch_size``), ``G`` samples per prompt
(``rollout.num_samples``), ``R = B * G`` rows, ``P`` prompt width, ``N`` response budget.
Row ``r`` answers prompt ``group_ids[r] = r // G``; every per-token array is ``[R, N]``
over the response tokens only (the log-prob of response token ``t`` comes from the
hidden state at sequence position ``P + t - 1``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax.models import token_logprobs_from_hidden
from alignax.sampling import SamplingConfig, generate
from alignax.trainers import packing
from alignax.trainers.rl_rewards import RewardScorer


def response_forward(model, tokens, positions, attention_mask, *, prompt_len: int, temperature: float,
                     chunk_size: int | None, group: int = 1):
    """``(logps [R, N], entropy [R, N], values [R, N] or None)`` of the response tokens.

    One forward over prompt + response; the LM head only runs on the ``N`` positions that
    predict response tokens, at ``temperature`` (the sampler's), in float32. With
    ``group > 1`` the ``group`` rows that share a prompt run as one packed row (the prompt
    once; :func:`alignax.trainers.packing.pack_groups`): same outputs, fewer tokens.
    """
    if group > 1:
        packed_tokens, packed_positions, packed_mask, segments = packing.pack_groups(
            tokens, positions, attention_mask, prompt_len=prompt_len, group=group)
        out = model(packed_tokens, packed_positions, packed_mask, segment_ids=segments, return_logits=False)
        states = lambda x: packing.group_scoring_states(x, prompt_len=prompt_len, group=group)  # noqa: E731
    else:
        out = model(tokens, positions, attention_mask, return_logits=False)
        states = lambda x: x[:, prompt_len - 1 : -1]  # noqa: E731
    logps, entropy = token_logprobs_from_hidden(
        states(out.hidden), model, tokens[:, prompt_len:], chunk_size=chunk_size, temperature=temperature,
        with_entropy=True,
    )
    values = None if out.values is None else states(out.values)
    return logps, entropy, values


@dataclasses.dataclass
class Groups:
    """Sampled completions on the host, group-contiguous (``G`` rows per prompt)."""

    prompt_tokens: np.ndarray  # [R, P]
    prompt_mask: np.ndarray  # [R, P]
    tokens: np.ndarray  # [R, N]
    response_mask: np.ndarray  # [R, N]
    sampler_logps: np.ndarray  # [R, N] under the distribution sampled from
    stopped: np.ndarray  # [R] bool
    references: list[Mapping[str, Any]]  # [R], the prompt record each row answers
    completions: list[str]  # [R] decoded response text
    rewards: np.ndarray  # [R] total reward
    components: dict[str, np.ndarray]  # name -> [R]

    @property
    def size(self) -> int:
        return len(self.completions)

    def take(self, rows: np.ndarray) -> Groups:
        rows = np.asarray(rows)
        pick = lambda a: a[rows]  # noqa: E731
        return Groups(
            prompt_tokens=pick(self.prompt_tokens), prompt_mask=pick(self.prompt_mask), tokens=pick(self.tokens),
            response_mask=pick(self.response_mask), sampler_logps=pick(self.sampler_logps), stopped=pick(self.stopped),
            references=[self.references[i] for i in rows], completions=[self.completions[i] for i in rows],
            rewards=pick(self.rewards), components={k: pick(v) for k, v in self.components.items()},
        )

    @staticmethod
    def concat(parts: Sequence[Groups]) -> Groups:
        first = parts[0]
        cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
        return Groups(
            prompt_tokens=cat("prompt_tokens"), prompt_mask=cat("prompt_mask"), tokens=cat("tokens"),
            response_mask=cat("response_mask"), sampler_logps=cat("sampler_logps"), stopped=cat("stopped"),
            references=[r for p in parts for r in p.references], completions=[c for p in parts for c in p.completions],
            rewards=cat("rewards"),
            components={k: np.concatenate([p.components[k] for p in parts]) for k in first.components},
        )

    def full_sequences(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, positions, attention_mask)``, each ``[R, P + N]``: prompt then response."""
        tokens = np.concatenate([self.prompt_tokens, self.tokens], axis=1).astype(np.int32)
        attention = np.concatenate([self.prompt_mask, self.response_mask], axis=1).astype(np.int32)
        positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)
        return tokens, positions, attention


class Sampler:
    """Generates and scores groups for prompt batches (one compiled program per config)."""

    def __init__(self, graphdef: nnx.GraphDef, tokenizer, scorer: RewardScorer, config: SamplingConfig, *,
                 mesh, place: Callable[[np.ndarray], jax.Array]):
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.config = config
        self.mesh = mesh
        self.place = place
        self._generate = jax.jit(generate, static_argnums=0, static_argnames=("config",))

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        return self.tokenizer.batch_decode([row[m > 0].tolist() for row, m in zip(tokens, mask)],
                                           skip_special_tokens=True)

    def sample(self, state: nnx.State, prompt_batch: Mapping[str, Any], rng: jax.Array,
               config: SamplingConfig | None = None) -> tuple[Groups, float, int]:
        """Groups for one prompt batch, and ``(seconds, tokens generated)`` of the sampling."""
        import time

        config = config or self.config
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            out = self._generate(self.graphdef, state, self.place(prompt_batch["prompt_tokens"]),
                                 self.place(prompt_batch["prompt_attention_mask"]), rng, config=config)
        out = jax.device_get(out)
        seconds = time.perf_counter() - start
        g = config.num_samples
        references = [ref for ref in prompt_batch["references"] for _ in range(g)]
        completions = self.decode(out.tokens, out.response_mask)
        groups = Groups(
            prompt_tokens=np.asarray(out.prompt_tokens), prompt_mask=np.asarray(out.prompt_mask),
            tokens=np.asarray(out.tokens), response_mask=np.asarray(out.response_mask),
            sampler_logps=np.asarray(out.sampling_logps), stopped=np.asarray(out.stopped),
            references=references, completions=completions, rewards=np.zeros(len(completions), np.float32),
            components={},
        )
        self.score(groups)
        return groups, seconds, int(np.sum(out.response_mask))

    def score(self, groups: Groups) -> None:
        full = None
        if self.scorer.reward_models is not None:
            tokens, positions, attention = groups.full_sequences()
            full = (self.place(tokens), self.place(positions), self.place(attention))
        groups.rewards, groups.components = self.scorer.score(
            groups.completions, groups.references, groups.tokens, groups.response_mask, full
        )


def evaluate_greedy(sampler: Sampler, state: nnx.State, batches, *, limit: int, config: SamplingConfig) -> dict[str, float]:
    """Greedy completions for up to ``limit`` prompts of ``batches`` (prompt-format batches
    with ``example_mask``), scored by the sampler's scorer: mean reward, mean length, each
    component's mean, ``accuracy`` (share of verifier-correct answers) and ``prompts``."""
    seen, sums = 0, {}
    for batch in batches:
        groups, _, _ = sampler.sample(state, batch, jax.random.key(0), config=config)
        keep = np.asarray(batch["example_mask"]) > 0
        keep &= np.cumsum(keep) <= (limit - seen)
        figures = {"reward": groups.rewards, "length": groups.response_mask.sum(axis=1).astype(np.float32),
                   **groups.components}
        for key, values in figures.items():
            sums[key] = sums.get(key, 0.0) + float(np.sum(np.asarray(values)[keep]))
        seen += int(keep.sum())
        if seen >= limit:
            break
    out = {k: v / max(seen, 1) for k, v in sums.items()}
    if "correct" in out:
        out["accuracy"] = out.pop("correct")
    out["prompts"] = float(seen)
    return out


def group_reward_std(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per-group population std of rewards, ``[R] -> [R / G]``."""
    return rewards.reshape(-1, group_size).std(axis=1)


def select_informative_groups(parts: Sequence[Groups], *, num_groups: int, group_size: int) -> tuple[Groups, int]:
    """DAPO dynamic sampling: the first ``num_groups`` groups whose rewards vary, topped up
    with zero-variance groups (which carry exactly zero advantage) if there are too few.

    Returns the chosen groups and how many of them have non-zero variance.
    """
    pool = Groups.concat(parts)
    std = group_reward_std(pool.rewards, group_size)
    informative = np.flatnonzero(std > 0)
    flat = np.flatnonzero(std == 0)
    chosen = np.concatenate([informative, flat])[:num_groups]
    rows = (chosen[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)
    return pool.take(rows), int(min(len(informative), num_groups))


def load_callable(spec: str) -> Callable:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None:
        raise ValueError(f"{module} has no {name!r}")
    return fn


def step_boundaries(tokenizer, tokens: np.ndarray, mask: np.ndarray, delimiter: str) -> tuple[np.ndarray, list[list[str]]]:
    """Where each completion's reasoning steps end, and the text of each step.

    A step ends at a response token whose decoded text contains ``delimiter`` and at the
    last response token. Returns ``(step_mask [R, N] int32, step texts per row)``.
    """
    step_mask = np.zeros(tokens.shape, np.int32)
    texts: list[list[str]] = []
    for r in range(tokens.shape[0]):
        length = int(mask[r].sum())
        pieces = [tokenizer.decode([int(t)]) for t in tokens[r, :length]]
        ends = [i for i, piece in enumerate(pieces) if delimiter in piece]
        if length and (not ends or ends[-1] != length - 1):
            ends.append(length - 1)
        step_mask[r, ends] = 1
        starts = [0] + [e + 1 for e in ends[:-1]]
        texts.append([tokenizer.decode(tokens[r, s : e + 1].tolist(), skip_special_tokens=True)
                      for s, e in zip(starts, ends)])
    return step_mask, texts


def process_step_rewards(fn: Callable, step_mask: np.ndarray, texts: list[list[str]],
                         references: Sequence[Mapping]) -> np.ndarray:
    """Step rewards ``[R, N]`` placed on the boundary tokens of ``step_mask``."""
    rewards_per_row = fn(texts, references)
    out = np.zeros(step_mask.shape, np.float32)
    for r, (ends, rewards) in enumerate(zip((np.flatnonzero(m) for m in step_mask), rewards_per_row)):
        rewards = np.asarray(rewards, np.float32)
        if rewards.shape != ends.shape:
            raise ValueError(f"process reward for completion {r}: {rewards.shape[0]} rewards for {ends.shape[0]} steps")
        if not np.all(np.isfinite(rewards)):
            raise ValueError(f"process reward for completion {r} is not finite: {rewards.tolist()}")
        out[r, ends] = rewards
    return out


def as_device_batch(arrays: Mapping[str, np.ndarray], place) -> dict[str, jax.Array]:
    return {k: place(np.asarray(v)) for k, v in arrays.items()}


def sequence_kl(old_logps: jax.Array, ref_logps: jax.Array, mask: jax.Array, kind: str) -> jax.Array:
    """Per-row sum of the per-token KL estimate over response tokens, ``[R]``."""
    from alignax.kl import kl_estimate

    kl = kl_estimate(old_logps, ref_logps, kind=kind)
    return jnp.sum(jnp.where(mask > 0, kl, 0.0), axis=-1)
