"""The precision policy (alignax/trainers/engine/precision.py, the ``precision:`` section).

- The optimiser wrapper: bfloat16 params with a float32 master follow the float32
  trajectory exactly and equal its bfloat16 rounding, where updating the bfloat16 params
  directly loses every 1e-6 step; the state's dtypes are the policy's; the float32
  policy is ``optax.adamw`` bit for bit.
- What stays float32 under bfloat16 compute, and how far a bfloat16 DPO step's loss is
  from the float32 one.
- The toy DPO and GRPO learning tasks pass under bfloat16; every trainer steps under it;
  a bfloat16 run resumes bit for bit (the master copy is in the checkpoint).
- The initial params are let go once the train state exists: a step sees exactly the
  weight-sized buffers it needs.
- Reward models, an LLM judge and a PRM are held in ``precision.frozen_dtype`` and score
  within bfloat16 rounding of their float32 selves.
"""

from __future__ import annotations

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from alignax.models import MODEL_KINDS, ModelConfig
from alignax.trainers.api import build_trainer, train
from alignax.trainers.engine.optim import OptimConfig, build_optimizer
from alignax.trainers.engine.precision import MasterWeightsState, PrecisionConfig, cast_floating, with_precision
from alignax.trainers.engine.setup import response_logps
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.trainer_helpers import perturbed, separable_pairs, sft_conversations, tiny_config, unpaired_feedback

BF16 = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}
DPO = {"beta": 0.5}  # every DPO run here, and the float32 learning test: their steps compile once (the XLA cache)


def dtypes(tree):
    return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)}


# ---------------------------------------------------------------------------- the optimiser wrapper
def _weights(n: int, seed: int = 0) -> np.ndarray:
    """``n`` weights of magnitude 1e-3..1e-1 (log-uniform), either sign. Half a bfloat16
    spacing there is at least 2**-18 ~ 3.8e-6, over three times an Adam step at lr 1e-6;
    ten such steps (1e-5) cross it for the smaller weights only."""
    rng = np.random.default_rng(seed)
    return (10 ** rng.uniform(-3, -1, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def _run(optimizer, params, grads_seq):
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    for grads in grads_seq:
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_master_weights_keep_the_updates_that_bfloat16_params_lose():
    n, steps, lr = 4096, 10, 1e-6
    config = OptimConfig(name="adamw", learning_rate=lr, schedule="constant", max_grad_norm=None)
    start = {"w": jnp.asarray(_weights(n)).astype(jnp.bfloat16).reshape(64, 64)}
    rng = np.random.default_rng(1)
    # gradients of one sign, so every weight moves the same way each step (~lr, ~1e-5 in all)
    grads = [{"w": jnp.asarray(rng.uniform(0.5, 1.5, size=(64, 64)), jnp.bfloat16)} for _ in range(steps)]

    master_policy = PrecisionConfig(param_dtype="bfloat16")
    with_master, _ = build_optimizer(config, steps, precision=master_policy)
    params, state = _run(with_master, start, grads)
    # The float32 trajectory, computed by plain optax.adamw from the same (upcast) start and gradients.
    reference, _ = _run(optax.adamw(lr, eps=1e-8, weight_decay=0.0), cast_floating(start, jnp.float32),
                        [cast_floating(g, jnp.float32) for g in grads])
    assert isinstance(state, MasterWeightsState)
    # to float32 rounding: the wrapper adds the step to the master inside the jitted update,
    # where XLA may fuse it (one rounding fewer) — a relative 1e-7, a hundredth of a 1e-5 step
    np.testing.assert_allclose(state.master["w"], reference["w"], rtol=3e-7, atol=0)
    assert params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(params["w"], state.master["w"].astype(jnp.bfloat16))
    moved = float(np.mean(np.asarray(state.master["w"]) != np.asarray(start["w"], np.float32)))
    changed = float(np.mean(np.asarray(params["w"]) != np.asarray(start["w"])))
    assert moved == 1.0  # every weight moved by ~1e-5 in float32 ...
    assert 0.01 < changed < 0.5  # ... and the bfloat16 weights it crossed a rounding boundary for changed

    # No master: each ~1e-6 step is under half a bfloat16 spacing and rounds away, ten times over.
    no_master_policy = PrecisionConfig(param_dtype="bfloat16", master_dtype=None)
    no_master, _ = build_optimizer(config, steps, precision=no_master_policy)
    lost, _ = _run(no_master, start, grads)
    assert float(np.mean(np.asarray(lost["w"]) != np.asarray(start["w"]))) == 0.0


def test_optimizer_state_dtypes_are_the_policys():
    config = OptimConfig(name="adamw", learning_rate=1e-3, schedule="constant", weight_decay=0.1)
    params = {"kernel": jnp.ones((4, 3), jnp.bfloat16), "scale": jnp.ones((3,), jnp.bfloat16)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)

    def adam_state(state):
        return next(s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                    if isinstance(s, optax.ScaleByAdamState))

    cases = [  # policy -> (master, mu, nu)
        (PrecisionConfig(param_dtype="bfloat16"), ("float32", "float32", "float32")),
        (PrecisionConfig(param_dtype="bfloat16", mu_dtype="bfloat16"), ("float32", "bfloat16", "float32")),
        (PrecisionConfig(param_dtype="bfloat16", master_dtype=None), (None, "float32", "float32")),
    ]
    for policy, (master, mu, nu) in cases:
        optimizer, _ = build_optimizer(config, 10, precision=policy)
        params_after, state = _run(optimizer, params, [grads])
        assert dtypes(params_after) == {"bfloat16"}, policy
        if master is None:
            assert not isinstance(state, MasterWeightsState)
        else:
            assert dtypes(state.master) == {master}
        adam = adam_state(state)
        assert (dtypes(adam.mu), dtypes(adam.nu)) == ({mu}, {nu}), policy

    # float32 params: mu_dtype alone, no wrapper
    f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    optimizer, _ = build_optimizer(config, 10, precision=PrecisionConfig(mu_dtype="bfloat16"))
    _, state = _run(optimizer, f32, [cast_floating(grads, jnp.float32)])
    adam = adam_state(state)
    assert (dtypes(adam.mu), dtypes(adam.nu)) == ({"bfloat16"}, {"float32"})

    # Why the second moment has no bfloat16 option: its running average moves 0.1% a step
    # (b2 = 0.999), under half a bfloat16 spacing (2**-9 = 0.2%): it could neither decay
    # nor follow a gradient twice as large.
    nu = jnp.asarray(1.0, jnp.bfloat16)
    for g2 in (0.0, 2.0):
        assert float((0.999 * nu + 0.001 * jnp.asarray(g2, jnp.bfloat16)).astype(jnp.bfloat16)) == 1.0


def test_float32_policy_is_optax_adamw_bit_for_bit():
    lr, wd = 3e-3, 0.1
    config = OptimConfig(name="adamw", learning_rate=lr, schedule="constant", weight_decay=wd, max_grad_norm=None)
    ours, _ = build_optimizer(config, 10, precision=PrecisionConfig())
    plain = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=wd, mask=lambda p: jax.tree.map(
        lambda x: x.ndim >= 2, p))
    rng = np.random.default_rng(0)
    params = {"kernel": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
              "bias": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(5)]
    a, _ = _run(ours, params, grads)
    b, _ = _run(plain, params, grads)
    for key in params:
        np.testing.assert_array_equal(a[key], b[key])
    chain = optax.identity()
    assert with_precision(chain, PrecisionConfig(mu_dtype="bfloat16")) is chain  # float32 params: no wrapper


# ---------------------------------------------------------------------------- what stays float32
def test_logprobs_values_rewards_and_losses_stay_float32_under_bfloat16_compute(tmp_path, toy_model):
    """Traced, not run (``jax.eval_shape``): the dtypes of what the models and a DPO loss return."""
    hf = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64)
    config = ModelConfig.from_hf_config(hf, param_dtype="bfloat16", dtype="bfloat16")
    tokens = jnp.zeros((2, 6), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    attention = jnp.ones((2, 6), jnp.int32)
    response = jnp.zeros((2, 6)).at[:, 3:].set(1)

    def traced(kind, fn):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: MODEL_KINDS[kind](config, rngs=nnx.Rngs(0))))
        assert dtypes(state) == {"bfloat16"}
        return jax.eval_shape(lambda s: fn(nnx.merge(graphdef, s)), state)

    out = traced("causal_lm", lambda m: m(tokens, positions, attention))
    assert out.hidden.dtype == jnp.bfloat16 and out.logits.dtype == jnp.float32
    logps, entropy, _ = traced("causal_lm", lambda m: response_logps(m, tokens, positions, attention, response,
                                                                     chunk_size=2, with_entropy=True))
    assert logps.dtype == entropy.dtype == jnp.float32
    assert traced("value", lambda m: m(tokens, positions, attention).values).dtype == jnp.float32
    assert traced("reward", lambda m: m(tokens, positions, attention).rewards).dtype == jnp.float32
    # a bfloat16 DPO loss and every one of its metrics are float32
    trainer = build_trainer(tiny_config(tmp_path, "dpo", steps=1, model_dir=toy_model, precision=BF16, preference=DPO),
                            records=separable_pairs(16))
    batch = trainer.placer(next(trainer.data.iterator("train")))
    loss, metrics = jax.eval_shape(trainer.task.loss_fn, trainer.params, {"reference": trainer.params}, batch,
                                   trainer.task.normalisers_fn(batch), jax.random.key(0))
    assert loss.dtype == jnp.float32 and dtypes(metrics) == {"float32"}


def test_a_bfloat16_dpo_step_loss_is_within_bfloat16_rounding_of_the_float32_step(tmp_path, toy_model):
    """The same policy (initial weights + noise) against the same reference, one step each.

    Tolerance 1e-2 on the loss. bfloat16 keeps 8 significant bits: weights and activations
    are rounded by up to 2**-9 relative. A response's log-prob here is a few tokens of at
    most ln 32 = 3.5 nats; a few roundings deep it is off by ~2**-8 of itself, ~0.04 nats.
    The loss -log sigmoid(beta * margin) moves by at most beta = 0.5 per nat of margin, and
    a margin sums four such log-probs: ~0.08 if every rounding went the same way. Independent
    roundings cancel (measured: 4e-4); 1e-2 leaves room for other platforms' bfloat16
    matmuls, and a bfloat16 log-softmax or loss (errors of ~2**-9 of each ~3.5-nat token
    log-prob, summed) would be caught more often than not.
    """
    records = separable_pairs(64)
    figures = {}
    for name, precision in (("float32", {}), ("bfloat16", BF16)):
        config = tiny_config(tmp_path / name, "dpo", steps=1, model_dir=toy_model, precision=precision, preference=DPO)
        trainer = build_trainer(config, records=records)
        policy = perturbed(cast_floating(trainer.params, jnp.float32), scale=0.05, seed=0)
        state, frozen = trainer.start()
        state = state._replace(params=cast_floating(policy, jnp.dtype(precision.get("param_dtype", "float32"))))
        batch = trainer.placer(next(trainer.data.iterator("train")))
        _, out = trainer.step(state, frozen, batch)
        figures[name] = {k: float(v) for k, v in jax.device_get(out.metrics).items()}
    f32, bf16 = figures["float32"], figures["bfloat16"]
    assert abs(f32["loss"] - np.log(2)) > 0.02  # the noise moved the policy off the reference
    assert abs(bf16["loss"] - f32["loss"]) < 1e-2
    assert abs(bf16["rewards/margins"] - f32["rewards/margins"]) < 2e-2
    assert bf16["grad_norm"] == pytest.approx(f32["grad_norm"], rel=0.02)


# ---------------------------------------------------------------------------- learning and stepping in bfloat16
def _train_capturing_frozen(config, records):
    """``(result of a run of config, the frozen models start() hands such a run)``: the
    program seam, asked of a trainer of its own (``train`` builds another and starts it
    the same way)."""
    _, frozen = build_trainer(config, records=records).start()
    return train(config, records=records), frozen


def _assert_bfloat16_state(state, masters: int = 1):
    """bfloat16 params with float32 master copies (one per optimiser) in the optimiser state."""
    found = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, MasterWeightsState))
             if isinstance(s, MasterWeightsState)]
    assert len(found) == masters and all(dtypes(m.master) == {"float32"} for m in found)
    assert dtypes(state.params) == {"bfloat16"}


def test_dpo_learns_a_separable_preference_in_bfloat16(tmp_path, toy_model):
    """tests/test_trainers.py::test_dpo_learns_a_separable_preference, bfloat16 params and compute
    (the trainer's step under the policy: float32 masters, a bfloat16 reference)."""
    config = tiny_config(tmp_path, "dpo", steps=30, model_dir=toy_model, preference=DPO, train={"save_every": 0},
                         precision=BF16)
    result, reference = _train_capturing_frozen(config, separable_pairs(96))
    _assert_bfloat16_state(result.loop.state)
    assert dtypes(reference) == {"bfloat16"}  # precision.frozen_dtype follows param_dtype
    before, after = result.eval_history[0], result.eval_history[-1]
    assert before["step"] == 0 and after["step"] == 30
    assert before["eval/rewards/accuracies"] == 0.0
    assert after["eval/rewards/accuracies"] >= 0.9
    assert after["eval/loss"] < before["eval/loss"] < 0.7
    assert all(np.isfinite(h["loss"]) for h in result.history)
    assert dtypes(nnx.state(result.model, nnx.Param)) == {"bfloat16"}


def test_grpo_raises_the_mean_reward_in_bfloat16(tmp_path, toy_model):
    """tests/test_online.py::test_online_rl_raises_the_mean_reward[grpo], bfloat16 params and compute."""
    config = toy_config(tmp_path, toy_model, "grpo", steps=20, checkpoint={"enabled": False}, precision=BF16)
    result, frozen = _train_capturing_frozen(config, toy_prompts(32))
    _assert_bfloat16_state(result.loop.state)
    assert dtypes(frozen["reference"]) == {"bfloat16"}
    rewards = np.array([h["reward/total"] for h in result.history])
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.3, rewards.round(3).tolist()
    assert result.eval_history[-1]["eval/reward"] > result.eval_history[0]["eval/reward"]
    assert all(np.isfinite(v) for row in result.history for v in row.values())


OFFLINE_ONE_STEP = {  # recipe, records, precision beyond BF16
    "sft": (sft_conversations, {}),
    "reward": (separable_pairs, {}),
    "kto": (unpaired_feedback, {"frozen_dtype": "float32", "mu_dtype": "bfloat16"}),
}


@pytest.mark.parametrize("algorithm", ["sft", "reward", "kto", "ppo"])
def test_every_trainer_steps_under_the_bfloat16_policy(tmp_path, toy_model, algorithm):
    """One step of each trainer's own step function (DPO's and GRPO's are the bfloat16
    learning tests above). PPO runs a separate critic with its own learning rate: two
    optimisers (``optax.multi_transform``), each with its master copy."""
    quiet = {"checkpoint": {"enabled": False}}
    if algorithm in OFFLINE_ONE_STEP:
        make_records, extra = OFFLINE_ONE_STEP[algorithm]
        config = tiny_config(tmp_path, algorithm, steps=1, model_dir=toy_model, precision={**BF16, **extra}, **quiet)
        trainer = build_trainer(config, records=make_records(16))
    else:
        config = toy_config(tmp_path, toy_model, "ppo", steps=1, precision=BF16, **quiet,
                            ppo={"critic_learning_rate": 1e-3})
        trainer = build_trainer(config, records=toy_prompts(8))
    state, frozen = trainer.start()
    _assert_bfloat16_state(state, masters=2 if algorithm == "ppo" else 1)
    batch = next(trainer.data.iterator("train"))
    if algorithm in OFFLINE_ONE_STEP:
        if algorithm == "kto":  # the reference, in precision.frozen_dtype
            assert dtypes(frozen) == {"float32"}
        state, out = trainer.step(state, frozen, trainer.placer(batch))
        figures = jax.device_get(out.metrics)
    else:
        assert dtypes(frozen["reference"]) == {"bfloat16"}
        state, out = trainer.rollout_step(state, frozen, batch, iter(()))
        figures = out.metrics
    assert figures["update_skipped"] == 0.0
    assert all(np.isfinite(float(v)) for v in figures.values()), figures
    assert dtypes(state.params) == {"bfloat16"}


def test_a_bfloat16_run_resumes_bit_for_bit_and_exports_its_master(tmp_path, toy_model):
    """tests/test_trainers.py::test_resume_reproduces_the_uninterrupted_run_bit_for_bit under
    the bfloat16 policy: the float32 master copy and the moments come back from the checkpoint.
    ``alignax export`` writes that float32 master (not its bfloat16 rounding) unless
    ``--dtype bfloat16`` is asked for."""
    from alignax.models.hf import read_hf_tensors, to_hf_state_dict
    from alignax.trainers.api import export

    records = separable_pairs(48)

    def config(where, steps, **sections):
        return tiny_config(tmp_path / where, "dpo", steps=steps, model_dir=toy_model, precision=BF16, preference=DPO,
                           **sections)

    def run(where, steps, **sections):
        return train(config(where, steps, **sections), records=records)

    full = run("full", 4, checkpoint={"enabled": False})  # saving does not touch the steps
    first = run("split", 2)
    resumed = run("split", 4)
    assert first.loop.last_step == 2 and [h["step"] for h in resumed.history] == [3, 4]
    assert [h["loss"] for h in full.history[2:]] == [h["loss"] for h in resumed.history]
    assert [h["grad_norm"] for h in full.history[2:]] == [h["grad_norm"] for h in resumed.history]
    a, b = nnx.state(full.model, nnx.Param), nnx.state(resumed.model, nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))

    master = resumed.loop.state.opt_state.master  # the float32 copy the optimiser updates
    as_master = nnx.clone(resumed.model)
    nnx.update(as_master, master)
    _, expected = to_hf_state_dict(as_master)
    _, rounded = to_hf_state_dict(resumed.model)
    written = read_hf_tensors(export(config("split", 4), str(tmp_path / "export")))
    bf16 = read_hf_tensors(export(config("split", 4), str(tmp_path / "export-bf16"), dtype="bfloat16"))
    assert written.keys() == expected.keys() == bf16.keys()
    moved = 0
    for name, value in expected.items():
        assert value.dtype == written[name].dtype == np.float32, name
        np.testing.assert_array_equal(written[name], value, err_msg=name)
        assert bf16[name].dtype == rounded[name].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(bf16[name], rounded[name], err_msg=name)
        moved += int(np.sum(value != np.asarray(rounded[name], np.float32)))
    assert moved > 0  # the master holds what its bfloat16 rounding lost
    # config.json says what was written: the float32 master of a bfloat16 run, or --dtype's
    assert [json.loads((tmp_path / d / "config.json").read_text())["dtype"] for d in ("export", "export-bf16")] \
        == ["float32", "bfloat16"]


def test_config_json_names_the_dtype_of_the_weights_written(toy_model, tmp_path):
    """`alignax export --dtype bfloat16` of a float32 run wrote bfloat16 weights under a
    config.json saying float32 (the dtype the model was built with): loaders that follow
    config.json (transformers' dtype="auto") then upcast, or mislabel, the checkpoint."""
    from alignax.models import from_pretrained, read_hf_tensors, save_pretrained

    model = from_pretrained(toy_model)
    assert model.config.param_dtype == "float32"
    nnx.update(model, cast_floating(nnx.state(model, nnx.Param), "bfloat16"))  # what export --dtype does
    save_pretrained(model, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {str(v.dtype) for v in read_hf_tensors(tmp_path / "bf16").values()} == {"bfloat16"}


# ---------------------------------------------------------------------------- the initial params are let go
def weight_buffers(shape, *, ignore=frozenset(), collect=True) -> list[jax.Array]:
    """The distinct device buffers of live arrays of ``shape`` (an array and the views JAX or
    Orbax hold of its shards share a buffer: counted once), one array per buffer; buffers in
    ``ignore`` (other tests' arrays alive in this process) are left out. ``collect=False``
    skips the garbage collection first (seconds in a worker that has run many tests): then
    garbage still holding a buffer is counted too, so a count can only err high."""
    if collect:
        gc.collect()
    seen = {}
    for array in jax.live_arrays():
        if array.shape == shape and not array.is_deleted():
            for shard in array.addressable_shards:
                pointer = shard.data.unsafe_buffer_pointer()
                if pointer not in ignore:
                    seen.setdefault(pointer, array)
    return list(seen.values())


@pytest.mark.parametrize("policy", ["float32", "bfloat16"])
def test_a_step_holds_only_the_weight_copies_it_needs(tmp_path, toy_model, policy, monkeypatch):
    """One step of the tiny DPO, counting the embedding-shaped buffers alive while it runs.

    float32: params, Adam's two moments, the reference: 4. bfloat16: params and the
    reference in bfloat16; the master copy and the moments in float32: 5. The initial params
    are the reference, not copied: the trainer lets go of them in ``start``. (Before, the
    reference was a copy made while the trainer still held them: 5 float32 buffers after
    ``start``, and for as long as code that steps after ``start``, like the benchmarks, ran.)"""
    config = tiny_config(tmp_path, "dpo", steps=2, model_dir=toy_model, train={"save_every": 0}, preference=DPO,
                         precision=BF16 if policy == "bfloat16" else {})
    trainer = build_trainer(config, records=separable_pairs(32))
    shape = trainer.params["model"]["embed"][...].shape
    # arrays of the same shape that earlier tests in this process still hold are not this run's
    mine = {x.addressable_shards[0].data.unsafe_buffer_pointer() for x in jax.tree.leaves(trainer.params)}
    before = frozenset(a.addressable_shards[0].data.unsafe_buffer_pointer() for a in weight_buffers(shape)) - mine
    others = [x.shape for path, x in jax.tree_util.tree_leaves_with_path(trainer.params) if "embed" not in str(path)]
    assert shape not in others  # the count below is the embedding's alone
    initial = trainer.params["model"]["embed"][...].unsafe_buffer_pointer()
    expected = {"float32": {"float32": 4}, "bfloat16": {"bfloat16": 2, "float32": 3}}[policy]
    seen = []

    def count(when):
        buffers = weight_buffers(shape, ignore=before, collect=False)
        seen.append((when, {d: sum(1 for b in buffers if jnp.dtype(b.dtype).name == d) for d in expected}))

    from alignax.trainers.offline.trainer import OfflineTrainer

    compile_step = OfflineTrainer._compile_step  # what train() starts with (start() less the frozen inputs)

    def counting_start(self):
        state = compile_step(self)
        reference = self.reference
        assert self.params is None
        step = self.step

        def counting_step(state, frozen, batch):
            count(f"step {len(seen)}")
            return step(state, frozen, batch)

        self.step = counting_step
        assert reference["model"]["embed"][...].unsafe_buffer_pointer() == initial  # not a copy
        count("after start")
        return state

    monkeypatch.setattr(OfflineTrainer, "_compile_step", counting_start)
    trainer.train()  # with its checkpoints (the reference is saved before the first step)
    assert seen == [("after start", expected), ("step 1", expected), ("step 2", expected)]


# ---------------------------------------------------------------------------- the config keys
def test_precision_keys_are_checked_when_the_config_loads():
    from alignax.config import ConfigError
    from alignax.trainers.api import load_config

    def refused(data, overrides=()):
        with pytest.raises(ConfigError) as err:
            load_config(data=data, overrides=list(overrides))
        return str(err.value)

    dpo, sft = {"algorithm": "dpo"}, {"algorithm": "sft", "data": {"format": "sft"}}
    assert "model.param_dtype is read by no run (the dtypes moved to the precision section: set " \
           "precision.param_dtype and precision.compute_dtype)" in refused(dpo, ["model.param_dtype=bfloat16"])
    assert "model.dtype is read by no run" in refused(dpo, ["model.dtype=bfloat16"])
    assert "precision.master_dtype applies to precision.param_dtype=bfloat16 only; got precision.param_dtype=float32" \
        in refused(dpo, ["precision.master_dtype=null"])
    assert "precision.mu_dtype applies to optim.name=adamw|adam only; got optim.name=sgd" in refused(
        dpo, ["optim.name=sgd", "precision.mu_dtype=bfloat16"])
    assert "precision.frozen_dtype applies to a frozen model" in refused(sft, ["precision.frozen_dtype=bfloat16"])
    assert "only; got preference.loss=simpo" in refused(dpo, ["preference.loss=simpo", "precision.frozen_dtype=bfloat16"])
    config = load_config(data=dpo, overrides=["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
                                              "precision.master_dtype=null", "precision.mu_dtype=bfloat16",
                                              "precision.frozen_dtype=float32"])
    assert config.precision == PrecisionConfig("bfloat16", "bfloat16", None, "bfloat16", "float32")
    load_config(data={"algorithm": "grpo", "data": {"format": "prompt"}}, overrides=["precision.frozen_dtype=bfloat16"])
    load_config(data={"algorithm": "ppo", "data": {"format": "prompt"}},
                overrides=["ppo.kl_coef=0", "rewards.reward_models=[runs/rm]", "precision.frozen_dtype=bfloat16"])
    for scorer in (["rewards.judge_model=runs/judge"], ["grpo.advantage=process", "grpo.process_reward_model=runs/prm"]):
        load_config(data={"algorithm": "grpo", "data": {"format": "prompt"}},
                    overrides=["grpo.kl_coef=0", *scorer, "precision.frozen_dtype=bfloat16"])
    assert "precision.frozen_dtype applies to a frozen model" in refused(
        {"algorithm": "grpo", "data": {"format": "prompt"}}, ["grpo.kl_coef=0", "precision.frozen_dtype=bfloat16"])
    # a config built in code, never validated, is refused when the model is built
    from alignax.trainers.config import ModelSpec
    from alignax.trainers.engine.setup import build_model

    with pytest.raises(ValueError, match="model.dtype is no longer read: set precision.compute_dtype"):
        build_model(ModelSpec(dtype="bfloat16"))


# ---------------------------------------------------------------------------- frozen scoring models
@pytest.fixture(scope="module")
def toy_scorer(tmp_path_factory, toy_model):
    """A reward-model folder on the toy model (a fresh random score head)."""
    from alignax.models import from_pretrained, save_pretrained

    directory = str(tmp_path_factory.mktemp("toy-scorer"))
    save_pretrained(from_pretrained(toy_model, kind="reward", new_head=True, seed=3), directory)
    return directory


def _param_dtypes(state) -> set[str]:
    return dtypes(nnx.state(nnx.merge(*state) if isinstance(state, tuple) else state, nnx.Param))


# bfloat16 keeps 8 significant bits: each weight is off by at most 2**-9 of itself; through
# two layers computed in float32 the scores move by well under 2 % of their spread (measured
# here: 0.11 %), where a wrong model or a missing head moves them by all of it.
SCORE_RTOL = 2e-2


def test_scoring_models_load_in_the_frozen_dtype_and_score_as_float32_does(tmp_path, toy_model, toy_scorer):
    """Reward models, the LLM judge and a PRM hold their weights in ``param_dtype`` (the
    run's ``precision.frozen_dtype``; float32 when not given) and compute in float32; a
    bfloat16 reward model's scores are within :data:`SCORE_RTOL` of the float32 one's. The
    online trainer loads each of them so (the evaluation passes the same key)."""
    from alignax.rewards.composite import RewardModels
    from alignax.rewards.judge import Judge
    from alignax.rewards.process import ProcessRewardModel

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 32, size=(6, 12)), jnp.int32)
    attention = jnp.asarray(np.arange(12)[None] < rng.integers(4, 13, size=(6, 1)), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(attention, axis=-1) - 1, 0)

    scores = {}
    for dtype, given in (("float32", {}), ("bfloat16", {"param_dtype": "bfloat16"})):
        rms = RewardModels.load([toy_scorer], vocab_size=32, **given)
        assert _param_dtypes(rms.states[0]) == {dtype}
        scores[dtype] = rms.score_fn()(rms.states, tokens, positions, attention)[0]
        assert scores[dtype].dtype == jnp.float32  # computed in float32 whatever the weights
        assert _param_dtypes(ProcessRewardModel(toy_scorer, **given)._load()[1]) == {dtype}
        assert _param_dtypes(Judge(toy_model, **given).state) == {dtype}
    low, high = np.asarray(scores["bfloat16"], np.float64), np.asarray(scores["float32"], np.float64)
    assert np.ptp(high) > 0 and not np.array_equal(low, high)  # bfloat16 weights do change the scores ...
    np.testing.assert_allclose(low, high, atol=SCORE_RTOL * np.ptp(high), rtol=0)  # ... by rounding only

    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        precision={"frozen_dtype": "bfloat16"},
                        rewards={"reward_models": [toy_scorer], "judge_model": toy_model},
                        grpo={"advantage": "process", "step_delimiter": "no", "process_reward_model": toy_scorer})
    trainer = build_trainer(config, records=toy_prompts(8))
    assert _param_dtypes(trainer.actors.sampler.scorer.reward_models.states[0]) == {"bfloat16"}
    assert _param_dtypes(trainer.actors.sampler.scorer.judge.state) == {"bfloat16"}
    assert _param_dtypes(trainer.algorithm.process_reward._load()[1]) == {"bfloat16"}
    assert dtypes(trainer.actors.initial_params) == {"float32"}  # the policy keeps precision.param_dtype
