"""Math-Shepherd step labels for a set of step-by-step solutions (alignax.math_shepherd).

The policy, its sampler settings and the verifier come from a recipe (``model``,
``rollout.max_new_tokens`` / ``temperature``, ``rewards``); the solutions are format-``steps``
records (a JSONL file, or a generator spec such as ``reasoning_gym:chain_sum?size=16``,
whose labels are replaced). Each step prefix gets ``--samples`` completions; the labels
(``--estimator hard|soft``) are written as format ``steps`` JSONL, ready for ``algorithm:
prm``. Prints one JSON object: solutions, prefixes, mean label, seconds.

    .venv/bin/python tools/studies/math_shepherd.py configs/grpo.yaml SOLUTIONS OUT.jsonl \\
        [--samples 8 --estimator soft --batch-prefixes 8 --limit 32]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a recipe: the policy (model), rollout settings and rewards (the verifier)")
    parser.add_argument("solutions", help="format-steps JSONL, or a generator spec (reasoning_gym:chain_sum?size=16)")
    parser.add_argument("out", help="where to write the labelled JSONL")
    parser.add_argument("--samples", type=int, default=8, help="completions per step prefix (K)")
    parser.add_argument("--estimator", choices=("hard", "soft"), default="soft")
    parser.add_argument("--batch-prefixes", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="label only the first N solutions")
    parser.add_argument("--delimiter", default="\n")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe")
    args = parser.parse_args()

    from flax import nnx

    from alignax.data import builders, open_source, write_jsonl
    from alignax.evaluation import build_sampler
    from alignax.math_shepherd import label_solutions
    from alignax.parallel.sharding import mesh_for_shape
    from alignax.trainers.api import load_config
    from alignax.trainers.program import load_model, load_tokenizer

    config = load_config(args.config, args.overrides)
    if builders.is_generator_spec(args.solutions):
        solutions = builders.generate(args.solutions, "steps")
    else:
        source = open_source(args.solutions)
        solutions = [source[i] for i in range(len(source))]
    solutions = solutions[: args.limit]
    start = time.perf_counter()
    model = load_model(config)
    graphdef, state = nnx.split(model)
    tokenizer = load_tokenizer(config)
    sampler = build_sampler(graphdef, tokenizer, config, mesh=mesh_for_shape(config.mesh.shape, config.mesh.dcn_shape),
                            vocab_size=model.config.vocab_size)
    labelled = label_solutions(sampler, state, solutions, num_samples=args.samples, estimator=args.estimator,
                               delimiter=args.delimiter, temperature=config.rollout.temperature,
                               batch_prefixes=args.batch_prefixes, seed=config.train.seed)
    write_jsonl(labelled, args.out)
    labels = [y for r in labelled for y in r["labels"]]
    print(json.dumps({"solutions": len(labelled), "prefixes": sum(len(r["steps"]) - 1 for r in labelled),
                      "samples_per_prefix": args.samples, "estimator": args.estimator,
                      "mean_label": sum(labels) / max(len(labels), 1), "seconds": time.perf_counter() - start,
                      "out": args.out}))


if __name__ == "__main__":
    main()
