"""Best-of-N accuracy curves on SmolLM2-135M-Instruct with reasoning-gym chain_sum: selection
by the verifier, a trained ORM and a trained PRM, beside the oracle pass@N.

Trains an outcome reward model (configs/reward.yaml) and a process reward model
(configs/prm.yaml) for ``--steps`` steps each (skipped when their export exists), then
samples ``--n`` completions of ``--prompts`` held-out questions from the untrained policy
and reports ``best_of_n/<selector>@N`` (alignax.evaluation, evaluation.best_of_n); answers are
read as the ``<answer>`` tag or else the last number (SmolLM2 answers in prose). Prints
one JSON object (settings, figures, seconds per stage and in all, and the machine's load
average at the start and the end).

    .venv/bin/python tools/best_of_n_curves.py [--out runs/bon --steps 30 --n 8 --prompts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bon")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches judging each trained selector")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per batch (training and sampling)")
    parser.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                        help="unroll the layers (scanning them compiles one layer instead of 30)")
    args = parser.parse_args()

    from alignax.data import DataConfig
    from alignax.evaluation import evaluate_model
    from alignax.trainers.api import export, load_config, train
    from alignax.trainers.engine.setup import build_model, load_tokenizer

    seconds: dict[str, float] = {}
    began, load_before = time.perf_counter(), os.getloadavg()
    common = [f"train.total_steps={args.steps}", "train.eval_every=0", "train.save_every=0", "logging.tensorboard=false",
              f"data.batch_size={args.batch_size}", f"train.eval_batches={args.eval_batches}",
              f"model.scan_layers={str(args.scan_layers).lower()}"]
    selectors = {}
    for name, recipe in (("orm", "configs/reward.yaml"), ("prm", "configs/prm.yaml")):
        folder = os.path.join(args.out, name, "export")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            start = time.perf_counter()
            config = load_config(recipe, [*common, f"output_dir={os.path.join(args.out, name)}",
                                          "optim.learning_rate=3e-5", "optim.warmup_steps=0"])
            result = train(config)
            export(config, folder)
            seconds[f"train_{name}"] = time.perf_counter() - start
            selectors[f"{name}_eval"] = result.eval_history[-1] if result.eval_history else {}
        selectors[name] = folder

    config = load_config(data={
        "algorithm": "grpo", "output_dir": os.path.join(args.out, "policy"),
        "model": {"scan_layers": args.scan_layers},
        "data": {"paths": ["reasoning_gym:chain_sum?size=400&seed=7&max_terms=3&max_digits=1"], "format": "prompt",
                 "max_prompt_length": 128, "batch_size": args.batch_size, "eval_fraction": 0.2},
        "rollout": {"max_new_tokens": args.max_new_tokens},
        "rewards": {"verifier_weight": 1.0, "answer_extraction": "tag_or_last_number"},
        "evaluation": {"max_prompts": args.prompts, "temperature": 1.0,
                       "best_of_n": {"n": args.n, "reward_models": [selectors["orm"]], "prm": selectors["prm"]}},
    })
    start = time.perf_counter()
    model = build_model(config.model, precision=config.precision)
    figures = evaluate_model(model, load_tokenizer(config.model), config,
                             prompts=DataConfig(paths=("reasoning_gym:chain_sum?size=400&seed=7&max_terms=3&"
                                                       "max_digits=1",), format="prompt", max_prompt_length=128,
                                                batch_size=args.batch_size, read_threads=0))
    seconds["best_of_n"] = time.perf_counter() - start
    seconds["total"] = time.perf_counter() - began
    print(json.dumps({"settings": vars(args), "figures": figures, "selectors": selectors, "seconds": seconds,
                      "loadavg": {"start": load_before, "end": os.getloadavg()}}, indent=1))


if __name__ == "__main__":
    main()
