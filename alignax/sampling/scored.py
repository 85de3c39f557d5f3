"""Sampled completions, decoded and scored, on the host: what a rollout and a
generation-based evaluation both start from.

:class:`ScoredSampler` runs the on-device sampler (:func:`alignax.sampling.generate`, one
compiled program per sampling config) on a prompt batch, decodes the completions and
scores them with a reward scorer (:class:`alignax.rewards.composite.RewardScorer`, or
anything with its ``score`` method and ``reward_models`` attribute; full sequences are
passed where it ``reads_sequences``, default: where it holds reward models). The result is a
:class:`Groups`: ``G`` rows per prompt, group-contiguous, every per-token array ``[R, N]``
over the response tokens only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax.parallel.multihost import local_rows
from alignax.sampling.sampler import SamplingConfig, generate


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
    # Multi-turn trajectories (alignax.envs.rollout): response_mask is 1 on every real
    # token after the prompt (model and observation tokens), action_mask on the model's
    # own tokens only; trajectory holds per-row counts (turns, tool calls, end reasons).
    action_mask: np.ndarray | None = None  # [R, N]
    trajectory: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # name -> [R]

    def actions(self) -> np.ndarray:
        """``[R, N]``, 1 on the tokens the policy chose: the response (single turn), or
        the model's turns of a trajectory."""
        return self.response_mask if self.action_mask is None else self.action_mask

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
            action_mask=None if self.action_mask is None else pick(self.action_mask),
            trajectory={k: pick(v) for k, v in self.trajectory.items()},
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
            action_mask=None if first.action_mask is None else cat("action_mask"),
            trajectory={k: np.concatenate([p.trajectory[k] for p in parts]) for k in first.trajectory},
        )

    def full_sequences(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, positions, attention_mask)``, each ``[R, P + N]``: prompt then response."""
        tokens = np.concatenate([self.prompt_tokens, self.tokens], axis=1).astype(np.int32)
        attention = np.concatenate([self.prompt_mask, self.response_mask], axis=1).astype(np.int32)
        positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)
        return tokens, positions, attention


class ScoredSampler:
    """Generates and scores groups for prompt batches (one compiled program per config)."""

    def __init__(self, graphdef: nnx.GraphDef, tokenizer, scorer, config: SamplingConfig, *,
                 mesh, place: Callable[[np.ndarray], jax.Array],
                 score_place: Callable[[np.ndarray], jax.Array] | None = None):
        """``mesh``: where the sampler runs, ``place`` puts prompt rows on it;
        ``score_place`` puts full sequences where the reward models lie (default ``place``)."""
        self.graphdef = graphdef
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.config = config
        self.mesh = mesh
        self.place = place
        self.score_place = score_place or place
        self._generate = jax.jit(generate, static_argnums=0, static_argnames=("config",))

    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        return self.tokenizer.batch_decode([row[m > 0].tolist() for row, m in zip(tokens, mask)],
                                           skip_special_tokens=True)

    def sample(self, state: nnx.State, prompt_batch: Mapping[str, Any], rng: jax.Array,
               config: SamplingConfig | None = None) -> tuple[Groups, float, int]:
        """Groups for one prompt batch, and ``(seconds, tokens generated)`` of the sampling."""
        config = config or self.config
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            out = self._generate(self.graphdef, state, self.place(prompt_batch["prompt_tokens"]),
                                 self.place(prompt_batch["prompt_attention_mask"]), rng, config=config)
        out = jax.tree.map(local_rows, out)  # the samples of this process's prompts
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
        if getattr(self.scorer, "reads_sequences", self.scorer.reward_models is not None):
            tokens, positions, attention = groups.full_sequences()
            full = (self.score_place(tokens), self.score_place(positions), self.score_place(attention))
        groups.rewards, groups.components = self.scorer.score(
            groups.completions, groups.references, groups.tokens, groups.response_mask, full
        )
