"""Run by tests/test_online_mesh.py on 8 fake CPU devices: GRPO steps (sampling included)
of the real trainer on a (2, 2, 2) mesh against the same steps on one device, same seed;
and the sampler on its own mesh (``rollout.mesh``) from its compute-dtype copy of the
policy against the sampler on the training mesh from the training parameters. Prints one
JSON line of measured differences.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.parallel import batch_sharding, make_mesh
from alignax.parallel.sharding import batch_shards
from alignax.sampling.scored import ScoredSampler
from alignax.trainers.api import build_trainer, train
from alignax.trainers.engine.step import join_micro_rows, split_micro_batches
from tests.fsdp_compile_check import captured_stderr
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model


def run(model_dir, shape):
    """Two GRPO rollouts, 2 minibatches of 8 rows, each in 4 micro-batches of 2 rows (fewer
    rows than the (2, 2, 2) mesh has batch shards: split_micro_batches spreads each over
    the data groups). What XLA printed while compiling is returned with the run. No eval
    split: nothing here compares evaluations, and its greedy sampler would be one more
    program to compile per mesh."""
    with tempfile.TemporaryDirectory() as tmp:
        config = toy_config(tmp, model_dir, "grpo", steps=2, checkpoint={"enabled": False},
                            mesh={"shape": list(shape)}, grpo={"minibatches": 2}, train={"grad_accum_steps": 4},
                            data={"eval_fraction": 0.0})
        with captured_stderr() as log:
            result = train(config, records=toy_prompts(24))
    return result, nnx.state(result.model, nnx.Param), log.text


def sampler_copy(model_dir) -> dict:
    """float32 training params on (1, 8, 1) computing in bfloat16; the sampler on (2, 1, 4)
    (``rollout.mesh``: heads over 4 devices, rows over 2) from the trainer's copy
    (``sampling_state``) against the same prompts, key and params sampled on the training
    mesh as the sampler did before it had a mesh of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        sections = dict(checkpoint={"enabled": False}, mesh={"shape": [1, 8, 1]},
                        precision={"compute_dtype": "bfloat16"}, data={"batch_size": 8})
        own = build_trainer(toy_config(tmp, model_dir, "grpo", steps=1, rollout={"mesh": [2, 1, 4]}, **sections),
                            records=toy_prompts(24))
    # the sampler as it was before it had a mesh of its own: the training mesh and weights
    actors = own.actors
    shared = ScoredSampler(actors.graphdef, own.tokenizer, actors.sampler.scorer, actors.sampler.config,
                           mesh=own.mesh, place=actors.place)
    params = actors.initial_params
    copy = actors.sampling_state(params)
    kernels = [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(copy) if x.ndim >= 2]
    originals = dict(jax.tree_util.tree_leaves_with_path(nnx.merge_state(params, actors.rest)))
    batch = next(own.data.iterator("train"))
    key = jax.random.key(5)
    a, _, _ = actors.sampler.sample(copy, batch, key)
    b, _, _ = shared.sample(nnx.merge_state(params, actors.rest), batch, key)
    both = a.response_mask * b.response_mask
    return {
        "copy_kernel_dtypes": sorted({str(x.dtype) for _, x in kernels}),
        "copy_other_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(copy) if x.ndim < 2}),
        "copy_mesh": [int(n) for n in next(iter(kernels))[1].sharding.mesh.devices.shape],
        # the copy's kernels are the training kernels rounded to bfloat16, nothing else
        "copy_max_diff": max(float(np.max(np.abs(np.asarray(x, np.float32)
                                                 - np.asarray(originals[p].astype(x.dtype), np.float32))))
                             for p, x in kernels),
        "tokens_equal": float(np.mean(a.tokens == b.tokens)),
        "lengths_equal": bool(np.array_equal(a.response_mask, b.response_mask)),
        "max_sampler_logp_diff": float(np.max(np.abs(a.sampler_logps - b.sampler_logps) * both)),
        "rows": int(a.tokens.shape[0]),
    }


def micro_batch_split() -> dict:
    """Which rows split_micro_batches gives each of 4 micro-batches of 16 rows on (2, 2, 2)
    (4 batch shards of 4 rows), and that join_micro_rows restores the order."""
    mesh = make_mesh((2, 2, 2))
    rows = jax.device_put(np.arange(16, dtype=np.int32), batch_sharding(mesh, 1))

    def split_join(x):
        micro = split_micro_batches(x, 4)
        return micro, join_micro_rows(micro, {16: batch_shards(x)})

    micro, joined = jax.jit(split_join)(rows)
    return {"micro_rows": np.asarray(micro).tolist(), "micro_joined": np.asarray(joined).tolist()}


def param_diffs(a, b) -> dict[str, float]:
    """Largest and 99.9th-percentile absolute difference over every parameter entry."""
    diff = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))])
    return {"max_param_diff": float(diff.max()), "param_diff_p999": float(np.quantile(diff, 0.999))}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as model_dir:
        make_toy_model(model_dir)
        single, single_params, _ = run(model_dir, (1, 1, 1))
        sharded, sharded_params, sharded_log = run(model_dir, (2, 2, 2))
        copy = sampler_copy(model_dir)
    keys = ("reward/total", "loss", "grad_norm", "kl/ref_seq", "response/length_mean", "entropy")
    out = {
        "devices": jax.device_count(),
        **{f"single/{k}": [h[k] for h in single.history] for k in keys},
        **{f"sharded/{k}": [h[k] for h in sharded.history] for k in keys},
        **param_diffs(single_params, sharded_params),
        "sharded_param_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_params)),
        "sharded_involuntary_remat": sharded_log.count("Involuntary full rematerialization"),
        **micro_batch_split(),
    }
    out.update({f"sampler_copy/{k}": v for k, v in copy.items()})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
