"""Math-Shepherd step labels (Wang et al. 2024, "Math-Shepherd: Verify and Reinforce LLMs
Step-by-step without Human Annotations"): a step is as good as the chance that a policy,
continuing from the solution up to and including it, reaches the right answer.

For a solution ``s_1 .. s_n`` of a prompt, each prefix ``s_1 .. s_i`` (``i < n``) gets
``K`` completions from a policy on the on-device sampler (:class:`alignax.sampling.scored.
ScoredSampler`, in batches of prefixes); the run's verifier says which reach the answer.
With ``c_i`` of ``K`` correct, the paper's estimators are

- hard: ``y_i = 1`` if ``c_i > 0`` else 0 (some completion still reaches the answer);
- soft: ``y_i = c_i / K``, an unbiased estimate of the prefix's success probability ``p_i``
  (Hoeffding: ``P(|c_i / K - p_i| >= eps) <= 2 exp(-2 K eps^2)``).

The last step (the answer itself) is labelled by the verifier on the whole solution. The
output records are format ``steps`` (``prompt``, ``steps``, ``labels``) for ``algorithm: prm``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from alignax.data.formats import Encoder
from alignax.sampling.scored import ScoredSampler

ESTIMATORS = ("hard", "soft")


def hoeffding_epsilon(num_samples: int, delta: float) -> float:
    """The ``eps`` with ``P(|c / K - p| >= eps) <= delta`` for ``K`` independent samples."""
    return math.sqrt(math.log(2.0 / delta) / (2.0 * num_samples))


def labels_from_counts(correct: Sequence[int], num_samples: int, estimator: str) -> list[float]:
    """Step labels from the correct-completion counts ``c_i`` of each prefix."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown Math-Shepherd estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if estimator == "hard":
        return [float(c > 0) for c in correct]
    return [c / num_samples for c in correct]


def _left_padded(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> dict[str, np.ndarray]:
    tokens = np.full((len(rows), width), pad_id, np.int32)
    attention = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"prefix {i} has {len(row)} tokens; max_prompt_length is {width} (raise it)")
        tokens[i, width - len(row):], attention[i, width - len(row):] = row, 1
    return {"prompt_tokens": tokens, "prompt_attention_mask": attention}


def count_correct_completions(sampler: ScoredSampler, state, solutions: Sequence[Mapping[str, Any]], *,
                              num_samples: int, max_prompt_length: int | None = None, delimiter: str = "\n",
                              temperature: float = 1.0, batch_prefixes: int = 8, seed: int = 0,
                              success_threshold: float | None = None) -> list[list[int]]:
    """``c_i`` for every prefix ``s_1 .. s_i`` (``i < n``) of every solution: how many of
    ``num_samples`` completions from the policy ``state`` the sampler's scorer marks correct.

    ``solutions``: records with ``prompt`` (or ``question``), ``steps`` and what the verifier
    reads (``answer``, ``task``, ``metadata``). A prefix is the prompt as the sampler sees
    it (chat template, generation prompt) followed by each step and ``delimiter``, every
    step tokenised on its own, as format ``steps`` tokenises them for the PRM. Each
    prefix's reference is its record with ``shepherd_prefix``: the number of steps it holds
    minus one. A completion is correct by the verifier's verdict, or with
    ``success_threshold`` when its total reward reaches it. Prefixes are left-padded to
    ``max_prompt_length`` (``None``: the longest, rounded up to a multiple of 16).
    """
    tokenizer = sampler.tokenizer
    encoder = Encoder(tokenizer, format="prompt", max_prompt_length=10**9, max_length=10**9 + 1)
    prefixes, owners = [], []
    for s, record in enumerate(solutions):
        head = encoder.encode(record).prompt
        ids = list(head)
        for i, step in enumerate(record["steps"][:-1]):
            ids = ids + tokenizer.encode(step + delimiter, add_special_tokens=False)
            prefixes.append((ids, {**record, "shepherd_prefix": i}))
            owners.append((s, i))
    if max_prompt_length is None:
        max_prompt_length = -(-max((len(ids) for ids, _ in prefixes), default=1) // 16) * 16
    sampling = dataclasses.replace(sampler.config, greedy=False, temperature=temperature, top_k=0, top_p=1.0,
                                   num_samples=num_samples)
    pad = sampling.pad_id
    counts = [[0] * (len(r["steps"]) - 1) for r in solutions]
    key = jax.random.key(seed)
    for start in range(0, len(prefixes), batch_prefixes):
        chunk = prefixes[start:start + batch_prefixes]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_prefixes - real)  # one compiled shape; the copies are dropped
        batch = _left_padded([ids for ids, _ in chunk], max_prompt_length, pad)
        batch["references"] = tuple(ref for _, ref in chunk)
        groups, _, _ = sampler.sample(state, batch, jax.random.fold_in(key, start), config=sampling)
        if success_threshold is not None:
            verdicts = np.asarray(groups.rewards) >= success_threshold
        elif "correct" in groups.components:
            verdicts = np.asarray(groups.components["correct"])
        else:
            raise ValueError("Math-Shepherd labels need a verdict on each completion: a verifier "
                             "(rewards.verifier_weight != 0) or success_threshold")
        correct = verdicts.reshape(-1, num_samples)[:real].sum(axis=1)
        for (s, i), c in zip(owners[start:start + real], correct):
            counts[s][i] = int(round(c))
    return counts


def label_solutions(sampler: ScoredSampler, state, solutions: Sequence[Mapping[str, Any]], *, num_samples: int,
                    max_prompt_length: int | None = None, estimator: str = "soft", delimiter: str = "\n",
                    temperature: float = 1.0, batch_prefixes: int = 8, seed: int = 0,
                    success_threshold: float | None = None) -> list[dict]:
    """The ``solutions`` as format ``steps`` records with Math-Shepherd ``labels`` (and the
    counts behind them, ``shepherd_correct``, ``shepherd_samples``)."""
    labels_from_counts([], num_samples, estimator)  # an unknown estimator fails before any sampling
    counts = count_correct_completions(sampler, state, solutions, num_samples=num_samples,
                                       max_prompt_length=max_prompt_length, delimiter=delimiter, temperature=temperature,
                                       batch_prefixes=batch_prefixes, seed=seed, success_threshold=success_threshold)
    whole = [delimiter.join(r["steps"]) for r in solutions]  # the last step: the verifier on the solution
    references = [{**r, "shepherd_prefix": len(r["steps"]) - 1} for r in solutions]
    rewards, parts = sampler.scorer.score(whole, references, np.zeros((len(solutions), 1), np.int32),
                                          np.ones((len(solutions), 1), np.int32))
    finals = rewards >= success_threshold if success_threshold is not None else parts["correct"]
    out = []
    for record, correct, final in zip(solutions, counts, finals):
        labels = labels_from_counts(correct, num_samples, estimator) + [float(final)]
        out.append({**record, "labels": labels, "shepherd_correct": correct, "shepherd_samples": num_samples})
    return out


def label_file(recipe: str, solutions: str, out: str, *, overrides: Sequence[str] = (), num_samples: int = 8,
               estimator: str = "soft", batch_prefixes: int = 8, limit: int | None = None,
               delimiter: str = "\n") -> dict[str, Any]:
    """``alignax label``: label the solutions ``solutions`` (format-``steps`` records in a file,
    or a generator spec such as ``reasoning_gym:chain_sum?size=16``, whose labels are
    replaced) with the policy, sampler settings (``rollout.max_new_tokens`` /
    ``temperature``) and verifier (``rewards``) of ``recipe``, and write them to ``out`` as
    format ``steps`` JSONL for ``algorithm: prm``. Returns the run's figures (solutions,
    prefixes labelled, mean label, seconds)."""
    import time

    from flax import nnx

    from alignax.config import ConfigError
    from alignax.data import builders, open_source, write_jsonl
    from alignax.evaluation import build_sampler
    from alignax.parallel.sharding import mesh_for_shape
    from alignax.trainers.api import load_config
    from alignax.trainers.program import load_model, load_tokenizer

    if estimator not in ESTIMATORS:
        raise ConfigError(f"--estimator {estimator!r}: valid: {', '.join(ESTIMATORS)}")
    for flag, value in (("--num-samples", num_samples), ("--batch-prefixes", batch_prefixes)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: expected a positive integer")
    config = load_config(recipe, overrides)
    if builders.is_generator_spec(solutions):
        records = builders.generate(solutions, "steps")
    else:
        source = open_source(solutions)
        records = [source[i] for i in range(len(source))]
    records = records[:limit]
    start = time.perf_counter()
    model = load_model(config)
    graphdef, state = nnx.split(model)
    sampler = build_sampler(graphdef, load_tokenizer(config), config,
                            mesh=mesh_for_shape(config.mesh.shape, config.mesh.dcn_shape),
                            vocab_size=model.config.vocab_size, model_config=model.config)
    labelled = label_solutions(sampler, state, records, num_samples=num_samples, estimator=estimator,
                               delimiter=delimiter, temperature=config.rollout.temperature,
                               batch_prefixes=batch_prefixes, seed=config.train.seed)
    write_jsonl(labelled, out)
    labels = [y for r in labelled for y in r["labels"]]
    return {"solutions": len(labelled), "prefixes": sum(len(r["steps"]) - 1 for r in labelled),
            "samples_per_prefix": num_samples, "estimator": estimator,
            "mean_label": sum(labels) / max(len(labels), 1), "seconds": time.perf_counter() - start, "out": out}
