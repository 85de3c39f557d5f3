"""Run by tests/test_online_mesh.py on 8 fake CPU devices: GRPO steps (sampling included)
of the real trainer on a (2, 2, 2) mesh against the same steps on one device, same seed;
and the sampler on its own mesh (``rollout.mesh``) from its compute-dtype copy of the
policy against the sampler on the training mesh from the training parameters. Prints one
JSON line of measured differences.

The bound on the parameter differences is a third run: one device with Gaussian noise of
float32's reduction-order size added to every gradient (``float32_noise_run``); the mesh
may differ from one device by no more than that run does. ``--sgd`` runs all three with
SGD (whose parameter difference is linear in the gradient noise, without Adam's
amplification): it measures the mesh's gradient noise against the noise model directly.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import alignax.trainers.online.update as online_update
from alignax.parallel import batch_sharding, make_mesh
from alignax.parallel.sharding import batch_shards
from alignax.sampling.scored import ScoredSampler
from alignax.trainers.api import build_trainer, train
from alignax.trainers.engine.step import join_micro_rows, split_micro_batches
from tests.fsdp_compile_check import captured_stderr
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model


def grpo_config(tmp, model_dir, shape):
    """Two GRPO rollouts, 2 minibatches of 8 rows, each in 4 micro-batches of 2 rows (fewer
    rows than the (2, 2, 2) mesh has batch shards: split_micro_batches spreads each over
    the data groups). No eval split: nothing here compares evaluations, and its greedy
    sampler would be one more program to compile per mesh. ``--sgd``: plain SGD at lr 1
    instead of AdamW at 2e-2 (at 2e-2 the noise SGD passes on, lr * delta ~ 1e-9, would
    sit under the float32 spacing of the parameters, ~4e-9 at |p| ~ 0.05)."""
    optim = {"name": "sgd", "learning_rate": 1.0} if "--sgd" in sys.argv else {}
    return toy_config(tmp, model_dir, "grpo", steps=2, checkpoint={"enabled": False}, mesh={"shape": list(shape)},
                      grpo={"minibatches": 2}, train={"grad_accum_steps": 4}, data={"eval_fraction": 0.0}, optim=optim)


def run(model_dir, shape):
    """The run of :func:`grpo_config` on ``shape``; what XLA printed while compiling is
    returned with it."""
    with tempfile.TemporaryDirectory() as tmp:
        with captured_stderr() as log:
            result = train(grpo_config(tmp, model_dir, shape), records=toy_prompts(24))
    return result, nnx.state(result.model, nnx.Param), log.text


def reduction_length(config) -> int:
    """K, the longest sum an update's gradient element is made of: a kernel's gradient sums
    one term per token over the update's rows, ``rows * (prompt + response tokens)``, where
    ``rows = batch_size * num_samples / minibatches`` (8 * 32 = 256 here); the mesh splits
    exactly these sums (rows over the batch shards) and the model's own contractions (32 to
    64 long) are shorter."""
    rows = config.data.batch_size * config.rollout.num_samples // config.grpo.minibatches
    return rows * (config.data.max_prompt_length + config.rollout.max_new_tokens)


def relative_gradient_noise(relative: float, seed: int = 0,
                            exact_zeros: bool = False) -> optax.GradientTransformationExtraArgs:
    """Adds to each gradient tensor ``g`` independent Gaussian noise of standard deviation
    ``relative * rms(g)``, drawn anew at each update (key: ``seed`` folded with the count).
    ``exact_zeros``: entries whose gradient is exactly 0 get none (a sum of zeros is 0 in
    any order: the embedding rows of tokens a minibatch never holds, which Adam would
    otherwise move by ~lr per update on noise alone)."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, tree = jax.tree.flatten(updates)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), state.count), len(leaves))
        noisy = [g + relative * jnp.sqrt(jnp.mean(jnp.square(g))) * jax.random.normal(k, g.shape, g.dtype)
                 * ((g != 0) if exact_zeros else 1) for g, k in zip(leaves, keys)]
        return jax.tree.unflatten(tree, noisy), optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


@contextlib.contextmanager
def noisy_gradients(relative: float, exact_zeros: bool = False):
    """Online trainers built inside add :func:`relative_gradient_noise` to the gradient
    before their optimiser (and its clipping) sees it."""
    build = online_update.build_optimizer

    def build_noisy(*args, **kwargs):
        optimizer, schedule = build(*args, **kwargs)
        return optax.chain(relative_gradient_noise(relative, exact_zeros=exact_zeros), optimizer), schedule

    online_update.build_optimizer = build_noisy
    try:
        yield
    finally:
        online_update.build_optimizer = build


def float32_noise_run(model_dir) -> tuple[dict, object]:
    """One device, every gradient perturbed by the error float32 makes summing K terms in
    another order: a sum of K terms rounded at each partial sum carries a random-walk error
    of about ``sqrt(K) * u`` times its size (u = 2**-24, float32's unit roundoff; the
    typical error, not Higham's worst case ``K * u``), so each element gets noise of
    standard deviation ``sqrt(K) * 2**-24 * rms(g)`` with K from :func:`reduction_length`.
    Whatever Adam and the rollouts make of that noise (an element g with noise delta moves
    by ~ lr * delta / |g|, and the moved parameters feed the next gradients) is what the
    mesh's own reordering may make of its noise; the same run with ``--sgd``, where the
    difference is linear in the noise, shows the mesh's noise inside the model."""
    with tempfile.TemporaryDirectory() as tmp:
        config = grpo_config(tmp, model_dir, (1, 1, 1))
        length = reduction_length(config)
        relative = float(np.sqrt(length) * 2.0**-24)
        with noisy_gradients(relative):
            result = train(config, records=toy_prompts(24))
    return {"reduction_length": length, "noise_relative": relative}, result


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


def otb_statistics(model_dir) -> dict:
    """The optimal token baseline's per-token pass (``log pi(y)``, ``sum pi^2``) and advantages
    of one rollout, priced on (2, 2, 2) and on one device from the same samples (sampled
    once, on one device) and the same initial weights: their largest differences."""
    from alignax.trainers.online.collect import Sampled

    priced = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ((1, 1, 1), (2, 2, 2)):
            config = toy_config(f"{tmp}/{len(priced)}", model_dir, "grpo", steps=1, checkpoint={"enabled": False},
                                mesh={"shape": list(shape)}, data={"eval_fraction": 0.0},
                                grpo={"advantage": "optimal_token_baseline"})
            trainer = build_trainer(config, records=toy_prompts(24))
            state, frozen = trainer.start()
            if not priced:
                batches = trainer.data.iterator("train")
                sampled = trainer.collector.sample(trainer.actors.sampling_state(state.params), next(batches),
                                                   batches, rollout_index=0, version=0)
            batch = trainer.collector.price(state, frozen, sampled)
            priced[shape] = {k: np.asarray(jax.device_get(v), np.float64) for k, v in
                             (("sum_pi_squared", batch.inputs.sum_pi_squared), ("stat_logps", batch.inputs.stat_logps),
                              ("advantages", batch.rollout.advantages))}
            priced[shape]["devices"] = len(batch.inputs.sum_pi_squared.sharding.device_set)
    one, mesh = priced[(1, 1, 1)], priced[(2, 2, 2)]
    on = sampled.groups.actions() > 0
    return {"otb/devices": mesh["devices"], "otb/tokens": int(on.sum()),
            "otb/sum_pi_squared_min": float(one["sum_pi_squared"][on].min()),
            "otb/advantage_abs_max": float(np.abs(one["advantages"]).max()),
            **{f"otb/max_{k}_diff": float(np.abs(one[k] - mesh[k])[on].max())
               for k in ("sum_pi_squared", "stat_logps", "advantages")}}


def param_diffs(a, b) -> dict[str, float]:
    """Largest and 99.9th-percentile absolute difference over every parameter entry."""
    diff = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))])
    return {"max_param_diff": float(diff.max()), "param_diff_p999": float(np.quantile(diff, 0.999))}


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="GRPO on a (2, 2, 2) mesh against one device and its noise bound")
    parser.add_argument("--sgd", action="store_true", help="plain SGD at lr 1 (grpo_config reads it)")
    parser.parse_args()
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as model_dir:
        make_toy_model(model_dir)
        single, single_params, _ = run(model_dir, (1, 1, 1))
        sharded, sharded_params, sharded_log = run(model_dir, (2, 2, 2))
        noise, noisy = float32_noise_run(model_dir)
        copy = sampler_copy(model_dir)
        otb = otb_statistics(model_dir)
    keys = ("reward/total", "loss", "grad_norm", "kl/ref_seq", "response/length_mean", "entropy")
    out = {
        "devices": jax.device_count(),
        **{f"single/{k}": [h[k] for h in single.history] for k in keys},
        **{f"sharded/{k}": [h[k] for h in sharded.history] for k in keys},
        **param_diffs(single_params, sharded_params),
        **{f"float32_noise/{k}": v for k, v in noise.items()},
        **{f"float32_noise/{k}": v for k, v in param_diffs(single_params, nnx.state(noisy.model, nnx.Param)).items()},
        "float32_noise/reward/total": [h["reward/total"] for h in noisy.history],
        "sharded_param_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_params)),
        "sharded_involuntary_remat": sharded_log.count("Involuntary full rematerialization"),
        **micro_batch_split(),
    }
    out.update({f"sampler_copy/{k}": v for k, v in copy.items()}, **otb)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
