"""``alignax generate``: sample completions for a prompt file, JSONL out.

    alignax generate MODEL_OR_RECIPE PROMPTS [--out FILE] [--step N] [--num-samples G]
                     [--temperature T | --greedy] [--top-k K] [--top-p P] [--max-new-tokens N]
                     [--batch-size B] [--max-prompt-length P] [--seed S] [dotted.key=value ...]

``MODEL_OR_RECIPE`` is what ``model.name`` accepts (a registry name, a Hugging Face folder
such as a run's ``export/``, or a hub id from the Hugging Face cache), or a recipe YAML: then
the run's trained policy at its latest checkpoint (``--step``), LoRA adapters merged, as
``alignax export`` would write it. ``PROMPTS`` is a prompt set as ``data.paths`` reads it
(JSONL, JSON, Parquet, a dataset folder, or a generator spec such as
``reasoning_gym:chain_sum?size=8``), read whole in file order; a recipe's prompts are
encoded as its training data are (``data.system_prompt``, ``field_map``, chat template), a
model's through its tokenizer's chat template. ``alignax best-of-n`` (:func:`best_of_n_file`)
samples N a prompt from a recipe and keeps the one its rewards score highest.

Each output line is one sample: ``record`` (the prompt's index in the file), ``sample``
(0..G-1), ``prompt`` (as the file gave it), ``completion`` (the decoded text, special
tokens dropped), ``tokens`` (generated, the stop token included) and ``finish``
(``stop``: a stop token ended it; ``length``: ``--max-new-tokens`` did). The sampler is
:func:`alignax.sampling.generate` (one compiled prefill + decode loop), seeded by ``--seed``
and the batch index, so the same command writes the same file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax import paths
from alignax.config import ConfigError
from alignax.data import DataConfig, prepare_dataset
from alignax.sampling import SamplingConfig, generate


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """How ``alignax generate`` samples (its flags). ``temperature`` is ignored when
    ``greedy``; ``stop_token_ids`` default to the tokenizer's end of sequence."""

    num_samples: int = 1
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    batch_size: int = 8
    max_prompt_length: int | None = None  # the model's context less max_new_tokens, at most 512
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


def is_recipe(source: str) -> bool:
    """Whether ``source`` names a recipe YAML (a run) rather than a model."""
    return source.endswith((".yaml", ".yml")) and os.path.isfile(source)


def load_policy(source: str, *, step: int | None = None, overrides: Sequence[str] = (),
                config=None) -> tuple[nnx.Module, Any]:
    """``(policy, tokenizer)``: a model by name, or a recipe's trained policy (its checkpoint
    at ``step``, default the latest; LoRA adapters merged) with the recipe's tokenizer.
    ``config``: the recipe's loaded config (:func:`recipe_config`), when the caller has it."""
    if not is_recipe(source):
        from alignax.models import registry

        if overrides:
            raise ConfigError(f"dotted overrides ({' '.join(overrides)}) configure a recipe; {source} names a model")
        if step is not None:
            raise ConfigError(f"--step {step} reads a recipe's checkpoint; {source} names a model")
        return registry.load(source, key="MODEL_OR_RECIPE")
    from alignax.trainers import api

    config = config if config is not None else api.load_config(source, overrides)
    trainer = api.build_trainer(config, with_data=False)
    params = api.restore_params(trainer, config, step)
    return trainer.export_models(params)[""], trainer.tokenizer


# a batch's prompts are cut to its longest, rounded up to this many columns: fewer padded
# prefill columns, and few distinct widths to compile for
_WIDTH_STEP = 32


def recipe_config(source: str, overrides: Sequence[str] = ()):
    """A recipe's loaded config (its model, and its ``data`` section: how its prompts are
    encoded); None for a model."""
    if not is_recipe(source):
        return None
    from alignax.trainers.api import load_config

    return load_config(source, overrides)


def prompt_width(options: GenerateOptions, context: int) -> int:
    """The prompt tokens a row holds: ``--max-prompt-length``, or the model's ``context``
    (``max_position_embeddings``) less ``--max-new-tokens``, at most 512."""
    room = context - options.max_new_tokens
    if options.max_prompt_length is None:
        if room < 1:
            raise ConfigError(f"--max-new-tokens {options.max_new_tokens} leaves no room for a prompt in the model's "
                              f"context of {context} tokens")
        return min(512, room)
    if options.max_prompt_length > room:
        raise ConfigError(f"--max-prompt-length {options.max_prompt_length} + --max-new-tokens "
                          f"{options.max_new_tokens} exceed the model's context of {context} tokens")
    return options.max_prompt_length


def prompt_set(prompts: str, base: DataConfig | None = None, **fields: Any) -> DataConfig:
    """``prompts`` read whole, in file order, as a prompt set: encoded as the recipe's data
    ``base`` encodes its prompts (``system_prompt``, ``field_map``, ``apply_chat_template``)
    when there is one; ``fields`` replace the rest (widths, batch size)."""
    base = base if base is not None else DataConfig()
    return dataclasses.replace(base, paths=(prompts,), format="prompt", shuffle=False, eval_fraction=0.0,
                               num_epochs=None, packing=False, read_threads=0, **fields)


def prompt_rows(prompts: str, tokenizer, options: GenerateOptions, width: int,
                base: DataConfig | None = None, *, records: Sequence[Mapping] | None = None
                ) -> Iterator[Mapping[str, Any]]:
    """Left-padded prompt batches of ``prompts`` in file order (the last one padded, its
    padding rows marked ``example_mask == 0``), ``width`` tokens at most (a longer prompt
    keeps its end), each batch cut to its longest prompt (rounded up to 32 columns).
    ``records``: in-memory prompt records read instead of the file (``prompts`` names them)."""
    config = prompt_set(prompts, base, max_prompt_length=width, batch_size=options.batch_size)
    data = prepare_dataset(config, tokenizer, records=records)
    for batch in data.iterator("train", ordered=True, process_index=0, process_count=1):
        used = int(np.max(np.sum(batch["prompt_attention_mask"], axis=1)))
        keep = min(width, -(-used // _WIDTH_STEP) * _WIDTH_STEP)
        yield {**batch, **{k: batch[k][:, width - keep:] for k in ("prompt_tokens", "prompt_attention_mask")}}


def sampling_config(tokenizer, options: GenerateOptions) -> SamplingConfig:
    eos = tokenizer.eos_token_id
    stop = tuple(options.stop_token_ids) or (eos,)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SamplingConfig(max_new_tokens=options.max_new_tokens, greedy=options.greedy,
                          temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                          stop_token_ids=stop, pad_id=pad, num_samples=options.num_samples)


def completions(model: nnx.Module, tokenizer, batches, options: GenerateOptions) -> Iterator[dict[str, Any]]:
    """One dict per sample (the module doc's fields), batch by batch."""
    sampling = sampling_config(tokenizer, options)
    graphdef, state = nnx.split(model)
    run = jax.jit(generate, static_argnums=0, static_argnames=("config",))
    for index, batch in enumerate(batches):
        rng = jax.random.fold_in(jax.random.key(options.seed), index)
        out = jax.device_get(run(graphdef, state, batch["prompt_tokens"], batch["prompt_attention_mask"], rng,
                                 config=sampling))
        texts = tokenizer.batch_decode([row[m > 0].tolist() for row, m in zip(out.tokens, out.response_mask)],
                                       skip_special_tokens=True)
        g = options.num_samples
        for r, text in enumerate(texts):
            b = r // g
            if not batch["example_mask"][b]:
                continue  # the padding rows of the last batch
            yield {"record": int(batch["record_index"][b]), "sample": r % g,
                   "prompt": batch["references"][b].get("prompt"), "completion": text,
                   "tokens": int(out.lengths[r]), "finish": "stop" if out.stopped[r] else "length"}


def run(source: str, prompts: str, out: str | None, options: GenerateOptions, *, step: int | None = None,
        overrides: Sequence[str] = ()) -> str:
    """Write every sample of ``prompts`` to ``out`` (default: ``<prompts>.completions.jsonl``
    beside a local file, else ``completions.jsonl``); returns the path written. The file is
    written whole or not at all (:func:`alignax.paths.write_text`)."""
    config = recipe_config(source, overrides)  # loaded once: the policy's and the prompts' settings
    model, tokenizer = load_policy(source, step=step, overrides=overrides, config=config)
    if out is None:
        local = not paths.is_remote(prompts) and os.path.isfile(prompts)
        out = f"{os.path.splitext(prompts)[0]}.completions.jsonl" if local else "completions.jsonl"
    width = prompt_width(options, model.config.max_position_embeddings)
    rows = completions(model, tokenizer, prompt_rows(prompts, tokenizer, options, width,
                                                      None if config is None else config.data), options)
    paths.write_text(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return out


def check_options(options: GenerateOptions) -> None:
    """The flags, each refused in one line naming it (SamplingConfig's own checks name fields)."""
    for flag, value in (("--num-samples", options.num_samples), ("--max-new-tokens", options.max_new_tokens),
                        ("--batch-size", options.batch_size), ("--max-prompt-length", options.max_prompt_length)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: expected a positive integer")
    if not options.greedy and not options.temperature > 0:
        raise ConfigError(f"--temperature {options.temperature:g}: expected > 0 (or --greedy)")
    if not 0 < options.top_p <= 1:
        raise ConfigError(f"--top-p {options.top_p:g}: expected a value in (0, 1]")
    if options.top_k < 0:
        raise ConfigError(f"--top-k {options.top_k}: expected >= 0 (0 keeps every token)")


def best_of_n_file(recipe: str, prompts: str, out: str, *, n: int, overrides: Sequence[str] = (),
                   checkpoint: bool = False, step: int | None = None, seed: int = 0) -> dict:
    """``alignax best-of-n``: ``n`` completions of every prompt of ``prompts`` from a recipe's
    policy (its ``model``, or with ``checkpoint`` the run's trained policy at ``step``, default
    the latest) at the rollout's sampling settings (``rollout.temperature`` / ``top_k`` /
    ``top_p`` / ``max_new_tokens``), each scored by the recipe's ``rewards:`` (verifiers,
    reward functions, reward models, a judge); one JSON line per prompt with the best
    completion, its reward and components, and every sample's reward. Returns the figures
    (prompts, mean best reward, mean reward of one sample)."""
    from alignax.evaluation import build_sampler, greedy_sampling, prompt_batches, rollout_sampling
    from alignax.parallel.sharding import mesh_for_shape
    from alignax.trainers.api import load_config
    from alignax.trainers.program import load_model, load_tokenizer

    if n < 1:
        raise ConfigError(f"--n {n}: expected a positive number of samples per prompt")
    config = load_config(recipe, overrides)
    if checkpoint or step is not None:
        model, tokenizer = load_policy(recipe, step=step, overrides=overrides, config=config)
    else:
        model, tokenizer = load_model(config), load_tokenizer(config)
    graphdef, state = nnx.split(model)
    mesh = mesh_for_shape(config.mesh.shape, config.mesh.dcn_shape)
    sampler = build_sampler(graphdef, tokenizer, config, mesh=mesh, vocab_size=model.config.vocab_size,
                            model_config=model.config)
    sampling = dataclasses.replace(rollout_sampling(greedy_sampling(config, tokenizer), config.rollout), num_samples=n)
    batches = prompt_batches(config, tokenizer, prompts=prompt_set(prompts, config.data))
    lines, best, single = [], [], []
    for index, batch in enumerate(batches):
        groups, _, _ = sampler.sample(state, batch, jax.random.fold_in(jax.random.key(seed), index), sampling)
        rewards = groups.rewards.reshape(-1, n)
        for b, row in enumerate(rewards):
            if not batch["example_mask"][b]:
                continue  # the padding rows of the last batch
            pick = b * n + int(np.argmax(row))  # the first of equal best rewards
            best.append(float(row.max()))
            single.append(float(row.mean()))
            lines.append({"record": int(batch["record_index"][b]), "prompt": batch["references"][b].get("prompt"),
                          "completion": groups.completions[pick], "reward": float(row.max()),
                          "components": {k: float(v[pick]) for k, v in groups.components.items()},
                          "rewards": [float(r) for r in row]})
    paths.write_text(out, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return {"prompts": len(lines), "n": n, "mean_best_reward": float(np.mean(best)) if best else 0.0,
            "mean_sample_reward": float(np.mean(single)) if single else 0.0, "out": out}


__all__ = ["GenerateOptions", "best_of_n_file", "check_options", "completions", "load_policy", "run", "sampling_config"]
