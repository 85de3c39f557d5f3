"""The gold signal of an online run (``monitor.gold``): a held-out prompt set, decoded
greedily by the current policy every ``monitor.gold.every`` rollouts and scored by
``monitor.gold.rewards`` — a verifier, an LLM judge, reward models or user functions, never
the training reward (``rewards``, refused when the config loads).

This is the "gold reward" of Gao, Schulman & Hilton 2022 ("Scaling Laws for Reward Model
Overoptimization"): the policy is optimised against the proxy (``rewards``); the gold score
on prompts it never trains on shows when the proxy's gains stop being real ones.

The gold set never meets the training prompts: :class:`GoldSignal` refuses a gold record
whose prompt ids equal a training record's (each set tokenised by its own template and
truncation) or whose prompt text does (whitespace aside, system messages aside: the same
question under another template), naming both records and the count.
"""

from __future__ import annotations

import dataclasses

from alignax import evaluation
from alignax.config import ConfigError
from alignax.data import PreparedData, prepare_dataset
from alignax.trainers.config import TrainConfig


class GoldOverlapError(ConfigError):
    """A gold prompt that is also a training prompt."""


def check_held_out(gold: PreparedData, train: PreparedData) -> None:
    """Raise :class:`GoldOverlapError` naming the first gold record whose prompt is a
    training record's (the run's ``train`` split; its eval split may be shared)."""
    trained = train.prompt_digests("train")
    overlap: dict[int, int] = {}  # gold record -> a training record with its prompt (ids or text)
    for key, i in gold.prompt_digests("train").items():
        if key in trained:
            overlap[i] = min(overlap.get(i, trained[key]), trained[key])
    if overlap:
        gold_record = min(overlap)
        train_record = overlap[gold_record]
        raise GoldOverlapError(
            f"monitor.gold.prompts: {gold.source.where(gold_record)} has the same prompt as the training record "
            f"{train.source.where(train_record)} (data.paths); {len(overlap)} of the "
            f"{gold.stats['train']} gold prompts are training prompts. A gold signal is measured on held-out "
            "prompts: remove them from the gold set (or from the training data)")


class GoldSignal:
    """Scores a policy on the gold set: :meth:`score` returns ``gold/score`` (the mean gold
    reward of the greedy completions), ``gold/length`` (tokens) and the gold reward's
    components (``gold/<name>``).

    ``actors``: the run's :class:`~alignax.trainers.online.actors.Actors` (the sampler's
    graphdef, mesh and weights); ``train_data``: the run's prepared data (checked for overlap)."""

    def __init__(self, config: TrainConfig, actors, train_data: PreparedData):
        gold = config.monitor.gold
        if gold.prompts is None:
            raise ValueError("monitor.gold.prompts is not set: there is no gold signal to build")
        self.actors, self.seed = actors, config.train.seed
        whole = dataclasses.replace(gold.prompts, eval_fraction=0.0, shuffle=False)
        self.data = prepare_dataset(whole, actors.tokenizer)
        check_held_out(self.data, train_data)
        gold_config = dataclasses.replace(config, rewards=gold.rewards)
        self.sampler = evaluation.build_sampler(
            actors.sampling_graphdef, actors.tokenizer, gold_config, mesh=actors.sampler_mesh,
            vocab_size=actors.model_config.vocab_size, model_config=actors.model_config,
            reward_mesh=actors.frozen_mesh("reward_models"))
        self.evaluation = evaluation.EvaluationConfig(max_prompts=gold.max_prompts, report=False)

    def score(self, params) -> dict[str, float]:
        """The gold figures of the policy ``params`` (the train state's)."""
        figures = evaluation.evaluate_policy(self.sampler, self.actors.sampling_state(params),
                                             self.data.iterator("train", ordered=True), self.evaluation,
                                             seed=self.seed)
        out = {"gold/score": figures["reward"], "gold/length": figures["length"]}
        out.update({f"gold/{k.removeprefix('reward/')}": v for k, v in figures.items() if k.startswith("reward/")})
        return out
