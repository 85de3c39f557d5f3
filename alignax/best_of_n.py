"""Best-of-N selection: of N sampled completions, keep the one a selector scores highest.

Selectors (``evaluation.best_of_n``, :class:`BestOfNConfig`):

- ``reward``: the run's own reward (its ``rewards:`` section: verifiers, reward functions,
  reward models); with a perfect verifier as the reward, best-of-N is pass@N;
- ``orm``: trained outcome reward models (``alignax export`` of a ``reward`` run), several
  combined by an ensemble rule (:func:`alignax.losses.ensemble_rewards`);
- ``prm_<aggregation>``: a trained process reward model (``alignax export`` of a ``prm``
  run) scoring each step of the completion (split at ``step_delimiter``, as in training),
  the step probabilities reduced by ``min`` (the weakest step, Lightman et al. 2023),
  ``product`` (all steps right) or ``last`` (the final step's score).

Accuracy against N is not read off one draw of N samples per prompt: from ``n`` samples,
:func:`best_of_k` gives the expected correctness of the selection over every subset of
``k <= n`` of them, as pass@k does for the oracle (Chen et al. 2021), so the curve at
N = 1, 2, 4, ... is unbiased and smooth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from alignax.losses import ensemble_rewards
from alignax.parallel.multihost import local_rows
from alignax.rewards.composite import RewardModels
from alignax.rewards.process import STEP_AGGREGATIONS, ProcessRewardModel, aggregate_step_scores, step_boundaries


@dataclasses.dataclass(frozen=True)
class BestOfNConfig:
    """Best-of-N evaluation (the ``evaluation.best_of_n:`` section); off while ``n`` is 0.

    Fields:
      n: samples per prompt (at ``evaluation.temperature``); figures at N = 1, 2, 4, ... and n.
      by_reward: select by the run's reward (``best_of_n/reward@N``).
      reward_models: ORM folders (``best_of_n/orm@N``), combined by ``ensemble`` / ``ensemble_k``.
      prm: a PRM folder (``best_of_n/prm_<aggregation>@N`` for each of ``prm_aggregation``).
      step_delimiter: where a completion's steps end (as ``data.step_delimiter`` of its training).
    The oracle, ``best_of_n/oracle@N``, is pass@N.
    """

    n: int = 0
    by_reward: bool = True
    reward_models: tuple[str, ...] = ()
    ensemble: Literal["mean", "min", "mean_minus_std", "mean_minus_var"] = "mean"
    ensemble_k: float = 1.0
    prm: str | None = None
    prm_aggregation: tuple[Literal["min", "product", "last"], ...] = STEP_AGGREGATIONS
    step_delimiter: str = "\n"

    def __post_init__(self):
        object.__setattr__(self, "reward_models", tuple(self.reward_models))
        object.__setattr__(self, "prm_aggregation", tuple(self.prm_aggregation))
        if self.n < 0:
            raise ValueError(f"evaluation.best_of_n.n must be >= 0 (0: off); got {self.n}")
        bad = [a for a in self.prm_aggregation if a not in STEP_AGGREGATIONS]
        if bad or not self.prm_aggregation:
            raise ValueError(f"evaluation.best_of_n.prm_aggregation must name some of {', '.join(STEP_AGGREGATIONS)}; "
                             f"got {list(self.prm_aggregation)}")
        if self.n and not (self.by_reward or self.reward_models or self.prm):
            raise ValueError("evaluation.best_of_n has no selector: set by_reward, reward_models or prm")

    def sizes(self) -> list[int]:
        """N = 1, 2, 4, ... up to ``n`` (``n`` itself included)."""
        out = [1 << i for i in range(self.n.bit_length()) if 1 << i <= self.n]
        return out + ([self.n] if out and out[-1] != self.n else [])


def _subset_share(available: int, n: int, k: int) -> float:
    """``C(available, k) / C(n, k)``: the chance a random k-subset of n avoids the rest."""
    if available < k:
        return 0.0
    return float(np.prod([(available - i) / (n - i) for i in range(k)]))


def best_of_k(scores: np.ndarray, correct: np.ndarray, k: int) -> np.ndarray:
    """Expected correctness ``[B]`` of the top-scored of ``k`` samples drawn without
    replacement from the ``n`` of each row (ties broken uniformly at random).

    With the samples' distinct scores ``v_1 > v_2 > ...``, ``h_j`` samples above ``v_j``
    and ``m_j`` at it, the best of a random k-subset scores ``v_j`` with probability
    ``(C(n - h_j, k) - C(n - h_j - m_j, k)) / C(n, k)``, and is then a uniform pick among
    the tied samples present, whose expected correctness is the level's mean. ``scores``
    and ``correct``: ``[B, n]``. A selector equal to the verdict gives pass@k exactly.
    """
    scores, correct = np.asarray(scores, np.float64), np.asarray(correct, np.float64)
    if scores.shape != correct.shape or scores.ndim != 2:
        raise ValueError(f"scores {scores.shape} and correct {correct.shape} must both be [B, n]")
    n = scores.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"best-of-{k} needs 1 <= k <= n = {n} samples per prompt")
    out = np.zeros(scores.shape[0])
    for b in range(scores.shape[0]):
        higher = 0
        for level in np.unique(scores[b])[::-1]:
            tied = scores[b] == level
            m = int(tied.sum())
            chance = _subset_share(n - higher, n, k) - _subset_share(n - higher - m, n, k)
            out[b] += chance * correct[b][tied].mean()
            higher += m
    return out


class Selectors:
    """The trained selectors of a :class:`BestOfNConfig`, loaded once; :meth:`scores` scores
    sampled completions (:class:`alignax.sampling.scored.Groups`) by each."""

    def __init__(self, config: BestOfNConfig, tokenizer, *, vocab_size: int, mesh=None, place=None):
        self.config = config
        self.tokenizer = tokenizer
        self.place = place or (lambda x: x)
        self.orms = (RewardModels.load(config.reward_models, mesh=mesh, vocab_size=vocab_size)
                     if config.reward_models else None)
        self._score_orms = self.orms.score_fn() if self.orms is not None else None
        self.prm = ProcessRewardModel(config.prm, mesh=mesh, place=self.place) if config.prm else None

    def prm_step_probs(self, groups) -> tuple[np.ndarray, np.ndarray]:
        """``(sigmoid of the PRM's score at every response token [R, N], step_mask [R, N])``."""
        step_mask, _ = step_boundaries(self.tokenizer, groups.tokens, groups.response_mask,
                                       self.config.step_delimiter)
        return self.prm.step_probs(groups), step_mask

    def scores(self, groups) -> dict[str, np.ndarray]:
        """``{selector name: [R] scores}`` (``reward``, ``orm``, ``prm_<aggregation>``)."""
        c = self.config
        out: dict[str, np.ndarray] = {}
        if c.by_reward:
            out["reward"] = np.asarray(groups.rewards, np.float64)
        if self.orms is not None:
            each = self._score_orms(self.orms.states, *(self.place(a) for a in groups.full_sequences()))  # [K, R]
            out["orm"] = np.asarray(local_rows(ensemble_rewards(each, method=c.ensemble, k=c.ensemble_k)), np.float64)
        if self.prm is not None:
            probs, step_mask = self.prm_step_probs(groups)
            for method in c.prm_aggregation:
                out[f"prm_{method}"] = aggregate_step_scores(probs, step_mask, method)
        return out


def best_of_n_kl(n: int) -> float:
    """The KL divergence of best-of-``n`` selection from the sampling policy, in nats:

        KL(pi_bon || pi) = log n - (n - 1) / n

    for a selector with no ties (Stiennon et al. 2020, appendix G.3; Gao et al. 2022, §2).
    With ties it is an upper bound. 0 at ``n = 1``; grows like ``log n``.
    """
    if n < 1:
        raise ValueError(f"best-of-n needs n >= 1; got {n}")
    return float(np.log(n) - (n - 1) / n)


def best_of_n_figures(selector_scores: dict[str, np.ndarray], correct: np.ndarray, n: int,
                      sizes: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-prompt ``best_of_n/<selector>@<N>`` ``[B]`` from group-contiguous ``[B * n]``
    scores and verdicts."""
    correct = np.asarray(correct).reshape(-1, n)
    return {f"best_of_n/{name}@{k}": best_of_k(np.asarray(scores).reshape(-1, n), correct, k)
            for name, scores in selector_scores.items() for k in sizes}

