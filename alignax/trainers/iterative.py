"""Iterative (online) DPO: rounds of sampling pairs from the current policy, labelling them,
and training the DPO family on them (Xu et al. 2023, "Some things are more CRINGE than
others"; Xiong et al. 2024, "Iterative Preference Learning from Human Feedback"; Yuan et al.
2024's self-rewarding rounds when the labeller is a judge).

``algorithm: iterative_dpo`` reads prompts (``data.format: prompt``). Round ``r`` (0-based):

1. the policy is the original model (round 0) or round ``r-1``'s trained policy;
2. it samples ``rollout.num_samples`` completions of every training prompt (``rollout.
   temperature``/``top_k``/``top_p``), which the run's ``rewards:`` score (a verifier, reward
   models, an LLM judge ``rewards.judge_model``, functions); a prompt's best and worst
   completion are a pair (chosen, rejected) when their rewards differ. The pairs are written
   to ``<output_dir>/round_<r>/pairs.jsonl`` once, so a resumed round trains on the same pairs;
3. a DPO run (the ``preference:`` section, ``train.total_steps`` steps) in ``round_<r>/`` trains
   the policy on them, against the round's starting policy (``iterative.reference:
   previous``) or the original model (``original``); its checkpoints make a stopped round
   resume exactly where it stopped (the engine's resume);
4. the trained policy is exported to ``round_<r>/export`` (what marks the round done), and
   judged by generation (``alignax.evaluation``) on the prompts' eval split, or
   ``evaluation.prompts``; ``<output_dir>/rounds.json`` lists each round's figures.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax import evaluation, paths
from alignax.data import prepare_dataset, write_jsonl
from alignax.models import save_pretrained
from alignax.parallel.sharding import mesh_for_shape
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import rundir
from alignax.trainers.engine.precision import master_params
from alignax.trainers.engine.session import TrainResult
from alignax.trainers.engine.setup import build_model, load_tokenizer
from alignax.trainers.offline import preference
from alignax.trainers.offline.trainer import OfflineTrainer


log = logging.getLogger(__name__)

def round_dir(config: TrainConfig, r: int) -> str:
    return os.path.join(config.output_dir, f"round_{r}")


def _export_dir(config: TrainConfig, r: int) -> str:
    return os.path.join(round_dir(config, r), "export")


def round_done(config: TrainConfig, r: int) -> bool:
    return os.path.isfile(os.path.join(_export_dir(config, r), "config.json"))


def last_round(config: TrainConfig, step: int | None = None) -> int:
    """The last finished round (``step``: that round, which must be finished); an error
    naming the directory when none is (its policy would be the untrained one)."""
    done = [r for r in range(config.iterative.rounds) if round_done(config, r)]
    if step is not None:
        if step not in done:
            raise FileNotFoundError(f"{config.output_dir}: round {step} of iterative DPO has not finished "
                                    f"(finished: {done or 'none'})")
        return step
    if not done:
        raise FileNotFoundError(f"{config.output_dir}: no round of iterative DPO has finished (no "
                                "round_<r>/export); train it first")
    return done[-1]


def export(config: TrainConfig, destination: str | None = None, *, step: int | None = None) -> str:
    """Copy the last finished round's policy (or round ``step``'s) to ``destination``
    (default ``<output_dir>/export``)."""
    destination = destination or os.path.join(config.output_dir, "export")
    if jax.process_index() == 0:
        shutil.copytree(_export_dir(config, last_round(config, step)), destination, dirs_exist_ok=True)
    return destination


def round_config(config: TrainConfig, r: int) -> TrainConfig:
    """The DPO run of round ``r``: its policy, pairs file and directory."""
    data = config.data
    policy = config.model if r == 0 else dataclasses.replace(config.model, name=_export_dir(config, r - 1),
                                                             random_init=None)
    budget = config.rollout.max_new_tokens
    pairs = dataclasses.replace(data, paths=(os.path.join(round_dir(config, r), "pairs.jsonl"),), format="preference",
                                max_length=data.max_prompt_length + budget + 1, max_response_length=budget + 1,
                                eval_fraction=0.0, split="train")
    # the whole run's --overwrite and --allow-changes were settled by IterativeTrainer.train
    checkpoint = dataclasses.replace(config.checkpoint, overwrite=False)
    return dataclasses.replace(config, algorithm="dpo", output_dir=round_dir(config, r), model=policy, data=pairs,
                               evaluation=dataclasses.replace(config.evaluation, prompts=None), checkpoint=checkpoint)


class _RoundTrainer(OfflineTrainer):
    """The DPO trainer of one round; with ``iterative.reference: original`` its reference is
    the original model rather than the round's starting policy."""

    def __init__(self, config: TrainConfig, original: TrainConfig | None):
        super().__init__(config, task_builder=preference.make_task, model_kind="causal_lm")
        self._original = original

    def _reference(self):
        if self._original is None:
            return None
        return self.reference_model_params(self._original)

    def initial_reference(self):
        reference = super().initial_reference()
        original = self._reference()
        return original if original is not None and reference is not None else reference


def sample_pairs(sampler, state: nnx.State, config: TrainConfig, round_index: int, *,
                 records: Sequence[Mapping] | None = None) -> tuple[list[dict], dict[str, float]]:
    """Pairs from the samples of the policy ``state`` (``sampler``, scoring with the run's
    rewards: :func:`alignax.evaluation.build_sampler`) of every training prompt (best vs worst
    reward of a prompt's ``rollout.num_samples``), and figures of the sampling."""
    tokenizer = sampler.tokenizer
    rc = config.rollout
    sampling = evaluation.rollout_sampling(sampler.config, rc)
    data = prepare_dataset(config.data, tokenizer, records=records)
    pairs, rewards, prompts = [], [], 0
    key = jax.random.fold_in(jax.random.key(config.train.seed), round_index)
    for index, batch in enumerate(data.iterator("train", ordered=True)):
        groups, _, _ = sampler.sample(state, batch, jax.random.fold_in(key, index), config=sampling)
        g = rc.num_samples
        for p in np.flatnonzero(np.asarray(batch["example_mask"]) > 0):
            rows = np.arange(p * g, (p + 1) * g)
            scores = groups.rewards[rows]
            prompts += 1
            rewards.extend(scores.tolist())
            best, worst = rows[int(np.argmax(scores))], rows[int(np.argmin(scores))]
            if scores.max() > scores.min() and groups.completions[best] != groups.completions[worst] \
                    and groups.completions[best].strip() and groups.completions[worst].strip():
                reference = groups.references[best]
                pairs.append({"prompt": reference["prompt"], "chosen": groups.completions[best],
                              "rejected": groups.completions[worst], "chosen_reward": float(scores.max()),
                              "rejected_reward": float(scores.min())})
    return pairs, {"prompts": float(prompts), "pairs": float(len(pairs)), "sample_reward": float(np.mean(rewards))}


class IterativeTrainer:
    """Runs the rounds of an ``iterative_dpo`` config (see the module docstring)."""

    def __init__(self, config: TrainConfig, *, records: Sequence[Mapping] | None = None, with_data: bool = True):
        del with_data
        self.config = config
        self.records = records
        self.tokenizer = load_tokenizer(config.model)
        self._sampler = None

    def _policy(self, r: int) -> nnx.Module:
        spec = round_config(self.config, r).model
        return build_model(spec, precision=self.config.precision)

    def _sampler_and_state(self, policy: nnx.Module):
        """One scored sampler for every round (the policies share their graph; one compile)."""
        graphdef, state = nnx.split(policy)
        if self._sampler is None:
            mesh = mesh_for_shape(self.config.mesh.shape, self.config.mesh.dcn_shape)
            self._sampler = evaluation.build_sampler(graphdef, self.tokenizer, self.config, mesh=mesh,
                                                     vocab_size=policy.config.vocab_size)
        return self._sampler, state

    def judge(self, policy: nnx.Module) -> dict[str, float]:
        """Generation figures of ``policy`` on the eval prompts (``alignax.evaluation``)."""
        sampler, state = self._sampler_and_state(policy)
        batches = evaluation.prompt_batches(self.config, self.tokenizer, records=self.records)
        return evaluation.evaluate_policy(sampler, state, batches, self.config.evaluation,
                                          seed=self.config.train.seed)

    def prepare_round(self, r: int) -> tuple[TrainConfig, dict[str, float]]:
        """Round ``r``'s DPO config, its pairs sampled and written first when they are not yet."""
        cfg = round_config(self.config, r)
        path = cfg.data.paths[0]
        figures: dict[str, float] = {}
        if not os.path.isfile(path):
            sampler, state = self._sampler_and_state(self._policy(r))
            pairs, figures = sample_pairs(sampler, state, self.config, r, records=self.records)
            if not pairs:
                raise ValueError(f"round {r}: no prompt's samples differ in reward (rollout.num_samples="
                                 f"{self.config.rollout.num_samples}); nothing to prefer")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_jsonl(pairs, path + ".tmp")
            os.replace(path + ".tmp", path)
        return cfg, figures

    def train_round(self, r: int) -> TrainResult:
        cfg, figures = self.prepare_round(r)
        original = self.config if self.config.iterative.reference == "original" else None
        with rundir.claim(cfg):
            trainer = _RoundTrainer(cfg, original)
            result = trainer.train()
        target = _export_dir(self.config, r)
        state = result.loop.state  # the next round starts from the weights as the optimiser holds them (float32 master)
        save_pretrained(trainer.model_from(master_params(state.params, state.opt_state)), target + ".tmp")
        self.tokenizer.save_pretrained(target + ".tmp")
        os.replace(target + ".tmp", target)
        self._figures[r] = {**figures, **{f"eval/{k}": v for k, v in self.judge(result.model).items()}}
        return result

    def _claim(self, run: rundir.RunDirectory) -> None:
        """The run directory's rounds are this config's: ``--overwrite`` removes earlier
        rounds; a config that changes what is trained needs ``--allow-changes`` (the rounds
        done would otherwise be reused silently)."""
        config, path = self.config, self.config.output_dir
        done = sorted(n for n in os.listdir(path) if n.startswith("round_") or n == "rounds.json")
        if config.checkpoint.overwrite and done and run.writer:
            log.warning("checkpoint.overwrite: removing the earlier rounds in %s (%s)", path, ", ".join(done))
            for name in done:
                target = os.path.join(path, name)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                else:
                    os.remove(target)
        elif done:
            bound, _ = rundir.saved_config_changes(path, config)
            if bound and not config.checkpoint.allow_changes:
                raise rundir.RunDirectoryError(
                    f"{path} holds rounds ({', '.join(done)}) of a config that trained otherwise: "
                    f"{rundir.describe_changes(bound)}. Continue them with --allow-changes "
                    "(checkpoint.allow_changes=true), undo the changes, or start over with --overwrite")
        run.write_config()

    def train(self) -> TrainResult:
        """Every round not yet done (a stopped round resumes from its checkpoints)."""
        with rundir.claim(self.config) as run:
            self._claim(run)
            return self._train_rounds()

    def _train_rounds(self) -> TrainResult:
        summary = os.path.join(self.config.output_dir, "rounds.json")
        self._figures: dict[int, dict[str, Any]] = {}
        if os.path.isfile(summary):
            with open(summary, encoding="utf-8") as f:
                self._figures = {int(k): v for k, v in json.load(f).items()}
        result = None
        if 0 not in self._figures and not round_done(self.config, 0):
            self._figures[-1] = {f"eval/{k}": v for k, v in self.judge(self._policy(0)).items()}
        for r in range(self.config.iterative.rounds):
            if round_done(self.config, r):
                continue
            result = self.train_round(r)
            os.makedirs(self.config.output_dir, exist_ok=True)
            with paths.atomic_open(summary, "w") as f:
                json.dump({str(k): v for k, v in sorted(self._figures.items())}, f, indent=2)
        if result is None:
            model = self._policy(self.config.iterative.rounds)
            result = TrainResult(config=self.config, model=model, tokenizer=self.tokenizer, loop=None, data_stats={})
        return dataclasses.replace(result, config=self.config)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """Generation figures of the last finished round's policy (or round ``step``'s)."""
        return self.judge(self._policy(last_round(self.config, step) + 1))

    @property
    def figures(self) -> dict[int, dict[str, Any]]:
        """Round -> figures (-1: the starting policy's evaluation)."""
        return self._figures
