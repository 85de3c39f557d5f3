"""Best-of-N accuracy curves on SmolLM2-135M-Instruct with reasoning-gym chain_sum: selection
by the verifier, a trained ORM and a trained PRM, beside the oracle pass@N.

Trains an outcome reward model (configs/reward.yaml) and a process reward model
(configs/prm.yaml) for ``--steps`` steps each (skipped when their export exists), then
samples ``--n`` completions of ``--prompts`` held-out questions from the untrained policy
and reports ``best_of_n/<selector>@N`` (alignax.evaluation, evaluation.best_of_n); answers are
read as the ``<answer>`` tag or else the last number (SmolLM2 answers in prose). Prints
one JSON object (settings, figures, seconds per stage and in all, and the machine's load
average at the start and the end).

The ORM's pairs: the recipe's (``--orm-pairs builder``: reasoning-gym's ``<answer>N</answer>``
strings, correct vs wrong) or the policy's own (``--orm-pairs policy``: ``--label-samples``
samples of each of ``--pair-prompts`` other chain_sum questions, a question's best and worst
by the verifier, as iterative DPO labels them; questions that are held out are left out).

    .venv/bin/python tools/studies/best_of_n_curves.py [--out runs/bon --steps 30 --n 8 --prompts 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def policy_pairs(args, config, questions: str) -> str:
    """``--orm-pairs policy``: pairs of the untrained policy's own samples of ``--pair-prompts``
    chain_sum questions (another seed; none of the ``--prompts`` held-out ones), a question's
    best vs worst by the verifier; written to ``<out>/orm_pairs.jsonl``."""
    from flax import nnx

    from alignax import evaluation
    from alignax.data import write_jsonl
    from alignax.data.builders import generate
    from alignax.parallel.sharding import mesh_for_shape
    from alignax.trainers.program import load_model, load_tokenizer, sample_pairs

    held_out = {r["prompt"] for r in generate(questions, "prompt")[:args.prompts]}
    records = [r for r in generate(questions.replace("seed=7", "seed=8"), "prompt") if r["prompt"] not in held_out]
    records = records[:args.pair_prompts]
    tokenizer = load_tokenizer(config)
    model = load_model(config)
    graphdef, state = nnx.split(model)
    sampler = evaluation.build_sampler(graphdef, tokenizer, config, mesh=mesh_for_shape(config.mesh.shape),
                                       vocab_size=model.config.vocab_size)
    labels = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_fraction=0.0),
                                 rollout=dataclasses.replace(config.rollout, num_samples=args.label_samples,
                                                             temperature=1.0))
    pairs, figures = sample_pairs(sampler, state, labels, 0, records=records)
    if len(pairs) < 8:
        raise ValueError(f"only {len(pairs)} of {len(records)} questions had samples the verifier tells apart; "
                         "raise --pair-prompts or --label-samples")
    path = os.path.join(args.out, "orm_pairs.jsonl")
    write_jsonl(pairs, path)
    print(json.dumps({"orm_pairs": figures}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bon")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches judging each trained selector")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per batch (training and sampling)")
    parser.add_argument("--orm-pairs", choices=("builder", "policy"), default="builder",
                        help="the ORM's training pairs: the recipe's synthetic ones, or the policy's own samples")
    parser.add_argument("--pair-prompts", type=int, default=128, help="--orm-pairs policy: questions sampled")
    parser.add_argument("--label-samples", type=int, default=4, help="--orm-pairs policy: samples a question")
    parser.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                        help="unroll the layers (scanning them compiles one layer instead of 30)")
    args = parser.parse_args()

    from alignax.data import DataConfig
    from alignax.evaluation import evaluate_model
    from alignax.trainers.api import export, load_config, train
    from alignax.trainers.program import load_model, load_tokenizer

    questions = "reasoning_gym:chain_sum?size=400&seed=7&max_terms=3&max_digits=1"
    policy = {
        "algorithm": "grpo", "output_dir": os.path.join(args.out, "policy"),
        "model": {"scan_layers": args.scan_layers},
        "data": {"paths": [questions], "format": "prompt", "max_prompt_length": 128, "batch_size": args.batch_size,
                 "eval_fraction": 0.2},
        "rollout": {"max_new_tokens": args.max_new_tokens},
        "rewards": {"verifier_weight": 1.0, "answer_extraction": "tag_or_last_number"},
    }

    seconds: dict[str, float] = {}
    began, load_before = time.perf_counter(), os.getloadavg()
    common = [f"train.total_steps={args.steps}", "train.eval_every=0", "train.save_every=0", "logging.tensorboard=false",
              f"data.batch_size={args.batch_size}", f"train.eval_batches={args.eval_batches}",
              f"model.scan_layers={str(args.scan_layers).lower()}"]
    selectors, orm_data = {}, []
    orm_folder = os.path.join(args.out, "orm", "export")
    if args.orm_pairs == "policy" and not os.path.isfile(os.path.join(orm_folder, "config.json")):
        start = time.perf_counter()
        pairs_path = policy_pairs(args, load_config(data=policy), questions)
        orm_data = [f"data.paths=[{pairs_path}]", f"data.max_response_length={args.max_new_tokens + 1}",
                    f"data.max_length={128 + args.max_new_tokens + 1}"]
        seconds["label_orm_pairs"] = time.perf_counter() - start
    for name, recipe in (("orm", "configs/reward.yaml"), ("prm", "configs/prm.yaml")):
        folder = os.path.join(args.out, name, "export")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            start = time.perf_counter()
            trained = load_config(recipe, [*common, f"output_dir={os.path.join(args.out, name)}",
                                           "optim.learning_rate=3e-5", "optim.warmup_steps=0",
                                           *(orm_data if name == "orm" else [])])
            result = train(trained)
            export(trained, folder)
            seconds[f"train_{name}"] = time.perf_counter() - start
            selectors[f"{name}_eval"] = result.eval_history[-1] if result.eval_history else {}
        selectors[name] = folder

    config = load_config(data={**policy, "evaluation": {
        "max_prompts": args.prompts, "temperature": 1.0,
        "best_of_n": {"n": args.n, "reward_models": [selectors["orm"]], "prm": selectors["prm"]}}})
    start = time.perf_counter()
    model = load_model(config)
    figures = evaluate_model(model, load_tokenizer(config), config,
                             prompts=DataConfig(paths=(questions,), format="prompt", max_prompt_length=128,
                                                batch_size=args.batch_size, read_threads=0))
    seconds["best_of_n"] = time.perf_counter() - start
    seconds["total"] = time.perf_counter() - began
    print(json.dumps({"settings": vars(args), "figures": figures, "selectors": selectors, "seconds": seconds,
                      "loadavg": {"start": load_before, "end": os.getloadavg()}}, indent=1))


if __name__ == "__main__":
    main()
