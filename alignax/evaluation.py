"""Generation-based evaluation of a policy on a prompt dataset: greedy accuracy and sampled
pass@k, scored by the run's verifiers, reward functions and reward models (its ``rewards:``
section, :class:`~alignax.rewards.composite.RewardScorer`), with a JSON report.

Figures (a flat ``dict[str, float]``; every mean is over real prompts only, so the padded
last batch of an eval split never biases them):

- ``prompts``: prompts evaluated (at most ``evaluation.max_prompts``);
- greedy decoding, one completion per prompt: ``accuracy`` (share of correct
  completions), ``reward`` (mean total reward), ``reward/<component>`` (each component's
  mean, e.g. ``reward/answer``, ``reward/fn/pkg.mod:fn``), ``length`` (mean response
  tokens, the stop token included), ``stop_rate`` and ``truncation_rate`` (the completion
  emitted a stop token / ran out of ``max_new_tokens``);
- with ``evaluation.pass_k``: ``n = max(pass_k)`` samples per prompt at
  ``evaluation.temperature`` (no top-k/top-p), ``pass@k`` for each k by the unbiased
  estimator of Chen et al. 2021 (:func:`pass_at_k`), and ``sampled/accuracy`` (the mean
  correctness of one sample, i.e. pass@1 estimated from all ``n``), ``sampled/reward``,
  ``sampled/length``, ``sampled/truncation_rate``.
- with ``evaluation.best_of_n.n`` (:mod:`alignax.best_of_n`): accuracy of best-of-N
  selection for N = 1, 2, 4, ..., n from the same samples, ``best_of_n/<selector>@N``
  (``reward``: the run's reward; ``orm``: trained reward models; ``prm_min`` /
  ``prm_product`` / ``prm_last``: a trained PRM), beside the oracle
  ``best_of_n/oracle@N`` (pass@N). Each figure is the expectation over every N-subset of
  the samples (:func:`alignax.best_of_n.best_of_k`).

A completion is *correct* when the verifier says so (its task score is 1; present whenever
``rewards.verifier_weight`` or ``rewards.format_weight`` is non-zero), or, with
``evaluation.success_threshold``, when its total reward reaches that threshold (reward
functions and reward models have no verdict of their own).

Entry points: :func:`evaluate_policy` (a :class:`~alignax.sampling.scored.ScoredSampler`,
a policy state and prompt batches: what a trainer calls), :func:`evaluate_model` (an
``nnx.Module`` + tokenizer + :class:`~alignax.trainers.config.TrainConfig`: builds the
sampler, scorer and prompt batches), :func:`write_report`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax import paths
from alignax.best_of_n import BestOfNConfig, Selectors, best_of_n_figures
from alignax.data import DataConfig, DataIterator, PreparedData, prepare_dataset
from alignax.rewards.composite import RewardModels, RewardScorer
from alignax.rewards.process import ProcessRewardModel
from alignax.parallel.multihost import allgather_rows, process_rows
from alignax.parallel.sharding import mesh_for_shape
from alignax.sampling import SamplingConfig
from alignax.sampling.scored import Groups, ScoredSampler

# ``config`` arguments are an ``alignax.trainers.config.TrainConfig`` (typed ``Any`` here:
# that module imports this one for ``TrainConfig.evaluation``).
TrainConfig = Any


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """Generation-based evaluation (the ``evaluation:`` section of a recipe).

    Fields:
      prompts: an eval prompt set (a ``DataConfig`` with ``format: prompt``), read whole in
        file order; ``null``: the run's own eval split where its data are prompts (online
        runs with ``data.eval_fraction > 0``).
      max_prompts: evaluate at most this many prompts (``null``: all of them).
      pass_k: k values of sampled pass@k; ``n = max(pass_k)`` samples per prompt (``[]``:
        greedy decoding only).
      temperature: sampling temperature of the pass@k samples.
      max_new_tokens: response budget; ``null``: ``rollout.max_new_tokens``.
      success_threshold: a completion is correct when its total reward is at least this;
        ``null``: the verifier's verdict (none without a verifier: no accuracy, no pass@k).
      report: write each evaluation's figures as JSON under
        ``<output_dir>/evaluation/`` (:func:`report_path`).
      best_of_n: best-of-N selection (:class:`alignax.best_of_n.BestOfNConfig`; off while
        ``best_of_n.n`` is 0); its samples are the pass@k ones, ``max(max(pass_k), n)`` per prompt.
    """

    prompts: DataConfig | None = None
    max_prompts: int | None = 128
    pass_k: tuple[int, ...] = ()
    temperature: float = 1.0
    max_new_tokens: int | None = None
    success_threshold: float | None = None
    report: bool = True
    best_of_n: BestOfNConfig = dataclasses.field(default_factory=BestOfNConfig)

    def __post_init__(self):
        object.__setattr__(self, "pass_k", tuple(sorted(set(int(k) for k in self.pass_k))))
        if self.prompts is not None and self.prompts.format != "prompt":
            raise ValueError(f"evaluation.prompts.format must be prompt (a prompt set); got {self.prompts.format!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"evaluation.max_prompts must be >= 1 or null; got {self.max_prompts}")
        if any(k < 1 for k in self.pass_k):
            raise ValueError(f"evaluation.pass_k values must be >= 1; got {list(self.pass_k)}")
        if not self.temperature > 0:
            raise ValueError(f"evaluation.temperature must be > 0; got {self.temperature}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"evaluation.max_new_tokens must be >= 1 or null; got {self.max_new_tokens}")


def pass_at_k(num_samples: int, num_correct, k: int) -> np.ndarray:
    """Unbiased pass@k of Chen et al. 2021 ("Evaluating Large Language Models Trained on
    Code", eq. 1): the chance that at least one of ``k`` samples drawn without replacement
    from ``n`` samples, ``c`` of them correct, is correct::

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    (the product form never forms the large binomials). ``num_correct``: ``c``, a scalar or
    an array of per-prompt counts; returns float64 of its shape (average it over prompts).
    """
    n = int(num_samples)
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per prompt")
    c = np.asarray(num_correct, np.int64)
    if np.any((c < 0) | (c > n)):
        raise ValueError(f"correct counts must be in [0, {n}]; got {c.min()}..{c.max()}")
    i = np.arange(1, n + 1, dtype=np.float64)
    factors = 1.0 - k / i  # [n]; factor i - 1 belongs to i
    # prod over i in (n - c, n]: cumulative products from the top.
    suffix = np.concatenate([np.cumprod(factors[::-1])[::-1], [1.0]])  # suffix[j] = prod_{i > j} factors
    out = 1.0 - suffix[n - c]
    return np.where(n - c < k, 1.0, out)


def _correct(groups: Groups, threshold: float | None) -> np.ndarray | None:
    if threshold is not None:
        return (groups.rewards >= threshold).astype(np.float64)
    if "correct" in groups.components:
        return np.asarray(groups.components["correct"], np.float64)
    return None


def _no_verdict_error() -> ValueError:
    return ValueError("evaluation.pass_k (and evaluation.best_of_n) needs a verdict on each completion: a verifier "
                      "(rewards.verifier_weight) or evaluation.success_threshold")


_SELECTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _selectors(sampler: ScoredSampler, state: nnx.State, config: BestOfNConfig) -> Selectors:
    """The best-of-N selectors of ``config``, loaded once per sampler (every evaluation of a run reuses them)."""
    cached = _SELECTORS.get(sampler)
    if cached is None or cached[0] != config:
        vocab_size = nnx.merge(sampler.graphdef, state).config.vocab_size
        cached = _SELECTORS[sampler] = (config, Selectors(config, sampler.tokenizer, vocab_size=vocab_size,
                                                          mesh=sampler.mesh, place=sampler.place))
    return cached[1]


class _Sums:
    """Running sums of per-prompt (or per-row) values and their counts."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, key: str, values: np.ndarray, keep: np.ndarray) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(np.sum(np.asarray(values, np.float64)[keep]))
        self.counts[key] = self.counts.get(key, 0.0) + float(np.sum(keep))

    def means(self) -> dict[str, float]:
        """Means over every process's rows (each process summed its own)."""
        sums, counts = self.sums, self.counts
        if jax.process_count() > 1 and sums:
            keys = sorted(sums)
            both = allgather_rows(np.array([[sums[k] for k in keys], [counts[k] for k in keys]])[None])
            sums, counts = dict(zip(keys, both[:, 0].sum(axis=0))), dict(zip(keys, both[:, 1].sum(axis=0)))
        return {k: float(sums[k] / counts[k]) if counts[k] else float("nan") for k in sums}


def _row_figures(groups: Groups, correct: np.ndarray | None) -> dict[str, np.ndarray]:
    out = {"reward": groups.rewards, "length": groups.response_mask.sum(axis=1),
           "stop_rate": groups.stopped.astype(np.float64), "truncation_rate": (~groups.stopped).astype(np.float64)}
    for name, values in groups.components.items():
        if name != "correct":
            out[f"reward/{name}"] = values
    if correct is not None:
        out["accuracy"] = correct
    return out


def evaluate_policy(sampler: ScoredSampler, state: nnx.State, batches: Iterable[Mapping[str, Any]],
                    config: EvaluationConfig, *, seed: int = 0) -> dict[str, float]:
    """The figures of the module docstring for the policy ``state`` (``sampler.graphdef``'s
    state) on prompt-format ``batches`` (with ``example_mask``: rows with 0 are padding).

    Decoding keeps the stop tokens and pad id of ``sampler.config``; the response budget is
    ``config.max_new_tokens`` or ``sampler.config.max_new_tokens``. The sampled part draws
    with ``fold_in(key(seed), batch index)``, so a rerun gives the same figures.
    """
    base = sampler.config
    budget = config.max_new_tokens or base.max_new_tokens
    # Greedy: the trainers' own greedy config (same static config, same compiled program).
    greedy = dataclasses.replace(base, max_new_tokens=budget, greedy=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_samples=1)
    best = config.best_of_n
    n = max(max(config.pass_k, default=0), best.n)
    sampled = (dataclasses.replace(base, max_new_tokens=budget, greedy=False, temperature=config.temperature, top_k=0,
                                   top_p=1.0, num_samples=n) if n else None)
    limit = config.max_prompts if config.max_prompts is not None else math.inf
    seen = 0
    greedy_sums, sampled_sums = _Sums(), _Sums()
    for index, batch in enumerate(batches):
        if seen >= limit:
            break
        # which prompts count is decided on the global batch (this process holds rows
        # process_rows of it), so every process samples the same batches
        real = allgather_rows(np.asarray(batch["example_mask"]) > 0)
        counted = real & (np.cumsum(real) <= limit - seen)
        if not counted.any():
            continue
        keep = counted[process_rows(len(counted))]
        groups, _, _ = sampler.sample(state, batch, jax.random.key(0), config=greedy)
        correct = _correct(groups, config.success_threshold)
        for key, values in _row_figures(groups, correct).items():
            greedy_sums.add(key, values, keep)
        if sampled is not None:
            groups, _, _ = sampler.sample(state, batch, jax.random.fold_in(jax.random.key(seed), index),
                                          config=sampled)
            correct = _correct(groups, config.success_threshold)
            if correct is None:
                raise _no_verdict_error()
            keep_rows = np.repeat(keep, n)
            figures = _row_figures(groups, correct)
            for key in ("accuracy", "reward", "length", "truncation_rate"):
                sampled_sums.add(f"sampled/{key}", figures[key], keep_rows)
            per_prompt = correct.reshape(-1, n).sum(axis=1).round().astype(np.int64)  # [B]
            for k in config.pass_k:
                sampled_sums.add(f"pass@{k}", pass_at_k(n, per_prompt, k), keep)
            if best.n:
                for k in best.sizes():
                    sampled_sums.add(f"best_of_n/oracle@{k}", pass_at_k(n, per_prompt, k), keep)
                scores = _selectors(sampler, state, best).scores(groups)
                for key, values in best_of_n_figures(scores, correct, n, best.sizes()).items():
                    sampled_sums.add(key, values, keep)
        seen += int(counted.sum())
    if seen == 0:
        raise ValueError("no prompts to evaluate: the prompt batches hold no real example (example_mask)")
    return {**greedy_sums.means(), **sampled_sums.means(), "prompts": float(seen)}


# ---------------------------------------------------------------------- from a run's config
def build_sampler(graphdef: nnx.GraphDef, tokenizer, config: TrainConfig, *, mesh: jax.sharding.Mesh,
                  vocab_size: int, model_config=None, rollout: bool = False,
                  reward_mesh: jax.sharding.Mesh | None = None) -> ScoredSampler:
    """A sampler scoring like the run's rollouts: ``config.rewards`` (its reward models
    loaded on ``reward_mesh``, default ``mesh``; they must have the policy's
    ``vocab_size``), the stop tokens of ``rollout.stop_token_ids`` (default: the
    tokenizer's EOS) and the response budget ``rollout.max_new_tokens``. Greedy, one
    sample a prompt; with ``rollout`` the rollout's own distribution
    (:func:`rollout_sampling`), as the online trainer samples. With ``config.env.name``
    set, the run's multi-turn rollouts with its environment
    (:class:`alignax.envs.rollout.EnvSampler`, which needs the policy's ``model_config``)."""
    from alignax.parallel import placement
    from alignax.parallel.multihost import place_rows

    rc = config.rollout
    reward_mesh = mesh if reward_mesh is None else reward_mesh
    # Greedy by default; evaluate_policy sets its own decoding (the rollout's sampling
    # distribution is training's, not the evaluation's).
    sampling = greedy_sampling(config, tokenizer)
    if rollout:
        sampling = rollout_sampling(sampling, rc)

    def place(value):
        return place_rows(value, mesh)

    if config.env.name is not None:
        from alignax.envs.registry import env_factory
        from alignax.envs.rollout import EnvSampler

        ec = config.env
        return EnvSampler(graphdef, model_config, tokenizer, env_factory(ec.name, ec.kwargs), sampling, mesh=mesh,
                          place=place, prompt_len=config.data.max_prompt_length, max_turns=ec.max_turns,
                          max_turn_tokens=ec.max_turn_tokens, max_observation_tokens=ec.max_observation_tokens)
    reward_models = None
    if config.rewards.reward_models:
        reward_models = RewardModels.load(config.rewards.reward_models, mesh=reward_mesh, vocab_size=vocab_size,
                                          param_dtype=config.precision.frozen)
        # host: held there; submesh: built on reward_mesh (the sub-mesh of a training run)
        reward_models.states = placement.place(reward_models.states, config.placement.reward_models)
    prm = None
    if config.rewards.prm:
        prm = ProcessRewardModel(config.rewards.prm, mesh=reward_mesh, param_dtype=config.precision.frozen,
                                 place=lambda value: place_rows(value, reward_mesh))
    scorer = RewardScorer(config.rewards, max_new_tokens=rc.max_new_tokens, stop_token_ids=sampling.stop_token_ids,
                          reward_models=reward_models, frozen_dtype=config.precision.frozen, prm=prm,
                          tokenizer=tokenizer)
    return ScoredSampler(graphdef, tokenizer, scorer, sampling, mesh=mesh, place=place,
                         score_place=lambda value: place_rows(value, reward_mesh))


def greedy_sampling(config: TrainConfig, tokenizer) -> SamplingConfig:
    """Greedy decoding, one sample a prompt, within ``rollout.max_new_tokens``, stopping at
    ``rollout.stop_token_ids`` (default: the tokenizer's EOS) and padding with its pad id
    (default: EOS)."""
    rc = config.rollout
    eos = tokenizer.eos_token_id
    stop = tuple(rc.stop_token_ids) if rc.stop_token_ids else (eos,)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SamplingConfig(max_new_tokens=rc.max_new_tokens, greedy=True, stop_token_ids=stop, pad_id=pad)


def rollout_sampling(base: SamplingConfig, rollout) -> SamplingConfig:
    """``base`` (stop tokens, pad, budget) with the rollout's sampling distribution:
    ``rollout.temperature`` / ``top_k`` / ``top_p`` and ``rollout.num_samples`` a prompt."""
    return dataclasses.replace(base, greedy=False, temperature=rollout.temperature, top_k=rollout.top_k,
                               top_p=rollout.top_p, num_samples=rollout.num_samples)


def prompt_batches(config: TrainConfig, tokenizer, *, prompts: DataConfig | None = None,
                   records: Sequence[Mapping] | None = None, run_data: PreparedData | None = None) -> DataIterator:
    """The prompt batches an evaluation of ``config`` reads (one pass, padded last batch).

    ``prompts`` (else ``config.evaluation.prompts``): that whole prompt set in file order.
    Without one: the eval split of the run's data when they are prompts (``run_data``: the
    run's already prepared data). ``records`` replace the files of whichever set is read.
    """
    prompts = prompts or config.evaluation.prompts
    if prompts is not None:
        if prompts.format != "prompt":
            raise ValueError(f"evaluation prompts need format prompt; got {prompts.format!r}")
        whole = dataclasses.replace(prompts, eval_fraction=0.0, shuffle=False)
        return prepare_dataset(whole, tokenizer, records=records).iterator("train", ordered=True)
    if config.data.format != "prompt":
        raise ValueError(f"no prompts to evaluate on: the run's data are format {config.data.format!r}; "
                         "set evaluation.prompts (a prompt set, format prompt)")
    data = run_data if run_data is not None else prepare_dataset(config.data, tokenizer, records=records)
    if data.stats.get("eval", 0) == 0:
        raise ValueError("no prompts to evaluate on: the eval split is empty; set data.eval_fraction > 0 "
                         "or evaluation.prompts")
    return data.iterator("eval")


def evaluate_model(model: nnx.Module, tokenizer, config: TrainConfig, *, prompts: DataConfig | None = None,
                   records: Sequence[Mapping] | None = None, evaluation: EvaluationConfig | None = None,
                   mesh: jax.sharding.Mesh | None = None) -> dict[str, float]:
    """:func:`evaluate_policy` of a policy module under ``config`` (rewards, rollout stop
    tokens and budget, ``evaluation`` settings unless ``evaluation`` replaces them) on
    :func:`prompt_batches`; ``mesh``: default ``config.mesh``."""
    if mesh is None:
        mesh = mesh_for_shape(config.mesh.shape, config.mesh.dcn_shape)
    graphdef, state = nnx.split(model)
    sampler = build_sampler(graphdef, tokenizer, config, mesh=mesh, vocab_size=model.config.vocab_size,
                            model_config=model.config)
    batches = prompt_batches(config, tokenizer, prompts=prompts, records=records)
    return evaluate_policy(sampler, state, batches, evaluation or config.evaluation, seed=config.train.seed)


# ---------------------------------------------------------------------- report
def report_path(output_dir: str, step: int) -> str:
    """Where a run's evaluation at ``step`` is reported: ``<output_dir>/evaluation/step_<step>.json``."""
    return os.path.join(output_dir, "evaluation", f"step_{int(step):08d}.json")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def write_report(path: str, figures: Mapping[str, float], **context: Any) -> str:
    """Write ``{"figures": figures, **context}`` as JSON to ``path`` (atomically; parent
    folders created) and return ``path``. ``context``: what the figures are of, e.g.
    ``step=``, ``model=``, ``evaluation=`` (dataclasses and NumPy values are converted)."""
    if "figures" in context:
        raise ValueError("'figures' is the report's own key; name the context value otherwise")
    payload = {"figures": {k: float(v) for k, v in figures.items()}, **context}
    paths.as_path(path).parent.mkdir(parents=True, exist_ok=True)
    paths.write_text(path, json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path
