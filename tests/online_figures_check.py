"""Short online runs' figures, recorded on one tree and compared bit for bit on another:
what a refactoring of the online trainer must leave unchanged (docs/online-trainer.md).

    PYTHONPATH=OLD_TREE python tests/online_figures_check.py record figures.json
    PYTHONPATH=NEW_TREE python tests/online_figures_check.py compare figures.json [CASE ...]

Ten cases (CASES), 3 rollouts each on the toy word model; every logged figure but timings
and ``alarm/no_signal`` (added after the four-room split), and the sum of every parameter
leaf. ``compare`` prints each difference and ``BAD <count>``. Recorded figures hold for one
jax version and backend only, so this is a check to run around a change, not a test."""
import json
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.trainers.api import train
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model

CASES = {
    "grpo": ("grpo", {}),
    "ppo_separate": ("ppo", dict(ppo={"critic": "separate", "epochs": 2, "minibatches": 2})),
    "ppo_shared_kl_reward": ("ppo", dict(ppo={"critic": "shared", "kl_placement": "reward", "kl_coef": 0.1})),
    "rloo": ("grpo", dict(grpo={"advantage": "rloo"})),
    "remax": ("grpo", dict(grpo={"advantage": "remax"})),
    "grpo_lora": ("grpo", dict(lora={"rank": 4, "alpha": 8.0})),
    "ppo_lora_adapter": ("ppo", dict(lora={"rank": 4, "alpha": 8, "merge_for_sampling": True},
                                     ppo={"critic": "adapter", "epochs": 1, "minibatches": 1})),
    "grpo_dynamic": ("grpo", dict(grpo={"dynamic_sampling": True, "max_refills": 2})),
    "grpo_kl_reward_2mb": ("grpo", dict(grpo={"kl_placement": "reward", "kl_kind": "k1", "minibatches": 2})),
    "grpo_sampler_logps": ("grpo", dict(rollout={"old_logps": "sampler"}, grpo={"epochs": 2})),
}


def run(names) -> dict:
    """Each case's figures (timings left out) and parameter sums, run in turn on one toy model."""
    model = make_toy_model(tempfile.mkdtemp(prefix="toy-"))
    out = {}
    for name in names:
        algo, sections = CASES[name]
        config = toy_config(tempfile.mkdtemp(prefix=name), model, algo, steps=3, checkpoint={"enabled": False},
                            **sections)
        result = train(config, records=toy_prompts(16))
        hist = [{k: v for k, v in row.items() if not k.startswith("perf/") and "time" not in k and k != "alarm/no_signal"}
                for row in result.history]
        params = [np.asarray(x).astype(np.float64).sum().item()
                  for x in jax.tree.leaves(jax.device_get(nnx.state(result.model, nnx.Param)))]
        out[name] = {"history": hist, "param_sums": params}
        print(name, "done", flush=True)
    return out


def compare(reference: dict, now: dict, names) -> int:
    """Prints each figure or parameter sum of ``now`` that differs from ``reference``; the count."""
    bad = 0
    for name in names:
        a, b = reference[name], json.loads(json.dumps(now[name]))
        for i, (ra, rb) in enumerate(zip(a["history"], b["history"], strict=True)):
            for k in sorted(set(ra) | set(rb)):
                va, vb = ra.get(k), rb.get(k)
                both_nan = isinstance(va, float) and isinstance(vb, float) and np.isnan(va) and np.isnan(vb)
                if va != vb and not both_nan:
                    print(f"DIFF {name} step {i} {k}: {va} != {vb}")
                    bad += 1
        if a["param_sums"] != b["param_sums"]:
            print(f"DIFF {name} params")
            bad += 1
        print(name, "checked", flush=True)
    return bad


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    names = sys.argv[3:] or list(CASES)
    figures = run(names)
    if mode == "record":
        with open(path, "w") as f:
            json.dump(figures, f, indent=1, sort_keys=True)
    else:
        with open(path) as f:
            print("BAD", compare(json.load(f), figures, names))
