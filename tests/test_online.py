"""Online RL end to end on a tiny word-level model and a toy verifiable task.

The reward is the share of "yes" in a completion (tests/support/rl_toy.py): PPO and GRPO must
raise it; the token-level invariants of the seeds are checked on real rollouts.
"""

import functools
import tempfile

import numpy as np
import pytest

from alignax.checkpoint import Checkpointer
from alignax.trainers.api import build_trainer as make_trainer
from alignax.trainers.api import train
from alignax.trainers.online import grpo
from alignax.trainers.online.collect import single_update
from alignax.trainers.online.rollout import Minibatch, Rollout
from alignax.trainers.online.trainer import OnlineTrainer
from alignax.rewards.composite import NonFiniteRewardError
from tests.support.rl_toy import toy_config, toy_prompts


def rewards_of(result):
    return np.array([h["reward/total"] for h in result.history])


def finite_history(result):
    for row in result.history:
        bad = {k: v for k, v in row.items() if not np.isfinite(v)}
        assert not bad, f"non-finite metrics at step {row['step']}: {bad}"


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_online_rl_raises_the_mean_reward(tmp_path, toy_model, algorithm):
    # PPO at lr 1e-2, not the toy's 2e-2: its 4 updates per rollout (2 epochs x 2
    # minibatches) at 2e-2 took approx_kl to 0.25 in the last update, and which way that
    # jump went depended on float32 noise: on jaxlib 0.12.1 the final policy put 0.96 on
    # EOS as its first token (greedy eval 0.0, the sampled reward 1.0 a step before); on
    # 0.10.2 it said "yes". At 1e-2 the rewards agree to 4 digits on 0.10.2, 0.11.2 and
    # 0.12.1 and the greedy eval ends at 1.0 on each (docs/jax-versions.md).
    lr = {"ppo": {"optim": {"learning_rate": 1e-2}}}.get(algorithm, {})
    config = toy_config(tmp_path, toy_model, algorithm, steps=20, checkpoint={"enabled": False}, **lr)
    result = train(config, records=toy_prompts(32))
    rewards = rewards_of(result)
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.3, rewards.round(3).tolist()
    assert result.eval_history[-1]["eval/reward"] > result.eval_history[0]["eval/reward"]
    finite_history(result)
    last = result.history[-1]
    for key in ("kl/ref_seq", "entropy", "clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean", "ratio_min",
                "ratio_max", "response/length_mean", "response/length_min", "response/length_max",
                "response/stop_rate", "response/truncation_rate", "grad_norm", "perf/generation_s",
                "perf/training_s", "mismatch/sampler_trainer_abs", "alarm/entropy_collapse"):
        assert key in last, key
    if algorithm == "ppo":
        assert "value/explained_variance" in last and "value/loss" in last
    else:
        assert "groups/zero_variance_fraction" in last


def test_first_minibatch_ratio_is_one_when_old_logps_are_recomputed(tmp_path, toy_model):
    # several epochs and minibatches: later minibatches move the policy, the first must not have
    config = toy_config(tmp_path, toy_model, "ppo", steps=3, checkpoint={"enabled": False},
                        ppo={"epochs": 2, "minibatches": 2})
    result = train(config, records=toy_prompts(16))
    for row in result.history:
        assert abs(row["first_minibatch/ratio_min"] - 1) <= 1e-5
        assert abs(row["first_minibatch/ratio_max"] - 1) <= 1e-5
    assert any(abs(row["ratio_max"] - 1) > 1e-3 for row in result.history)  # later minibatches are off-policy


@functools.cache
def one_rollout_step(toy_model: str, grad_accum_steps: int, *, reuse: bool = True, pack: str = "auto"):
    """``(params, figures)`` after one rollout step of the toy GRPO run on 16 prompts.
    ``reuse``: the update's own forward pass gives the old log-probs (the default for one
    update per rollout); ``pack``: ``rollout.pack_groups`` (``auto`` packs the toy groups
    of 4). Cached: the default run serves the reuse and the packing comparisons."""
    import jax

    config = toy_config(tempfile.mkdtemp(prefix="one-rollout-step-"), toy_model, "grpo", steps=1,
                        checkpoint={"enabled": False}, train={"grad_accum_steps": grad_accum_steps},
                        rollout={"pack_groups": pack})
    trainer = OnlineTrainer(config, grpo.build_algorithm(config), records=toy_prompts(16), single_pass=reuse)
    assert single_update(config, trainer.algorithm) and trainer.actors.pack_group == (1 if pack == "off" else 4)
    assert trainer.single_pass == reuse and trainer.collector.single_pass == reuse
    state, frozen = trainer.start()
    state, out = trainer.rollout_step(state, frozen, next(trainer.data.iterator("train")), iter(()))
    return jax.device_get(state.params), out.metrics


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_single_update_reuses_its_forward_pass_and_matches_the_separate_pass(toy_model, grad_accum_steps):
    """One update per rollout (GRPO's default): old log-probs, entropy and the mismatch
    figures come from the update's own forward pass; the step equals the two-pass one."""
    import jax

    runs = {reuse: one_rollout_step(toy_model, grad_accum_steps, reuse=reuse) for reuse in (True, False)}
    (params_a, fig_a), (params_b, fig_b) = runs[True], runs[False]
    assert fig_a["reward/total"] == fig_b["reward/total"]  # the same rollout
    assert fig_a["first_minibatch/ratio_min"] == fig_a["first_minibatch/ratio_max"] == 1.0
    for key in ("loss", "grad_norm", "entropy", "kl/ref_seq", "kl/ref_k3", "mismatch/sampler_trainer_abs",
                "mismatch/sampler_trainer_max", "approx_kl", "advantages/abs_mean"):
        np.testing.assert_allclose(fig_a[key], fig_b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # Adam's first step is ~lr * g / |g|: float noise in a near-zero gradient entry moves
    # its parameter by up to ~1e-5 here (lr 2e-2), so parameters get a looser tolerance.
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_several_updates_or_kl_in_the_reward_keep_the_separate_forward_pass(tmp_path, toy_model):
    from alignax.trainers.online import ppo

    config = toy_config(tmp_path, toy_model, "grpo", steps=1)
    assert single_update(config, grpo.build_algorithm(config))
    for sections in (dict(grpo={"minibatches": 2}), dict(grpo={"epochs": 2}),
                     dict(grpo={"kl_placement": "reward", "kl_kind": "k1"})):
        config = toy_config(tmp_path, toy_model, "grpo", steps=1, **sections)
        assert not single_update(config, grpo.build_algorithm(config)), sections
    config = toy_config(tmp_path, toy_model, "ppo", steps=1, ppo={"epochs": 1})
    assert not single_update(config, ppo.build_algorithm(config))  # the critic's values read the policy
    with pytest.raises(ValueError, match="single_pass"):
        OnlineTrainer(config, ppo.build_algorithm(config), records=toy_prompts(16), single_pass=True)


def test_sampler_log_probs_agree_with_the_trainer_at_temperature_one(tmp_path, toy_model):
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False})
    result = train(config, records=toy_prompts(16))
    assert result.history[0]["mismatch/sampler_trainer_max"] < 1e-4


def test_zero_variance_groups_give_zero_advantage_and_no_nan(tmp_path, toy_model):
    config = toy_config(tmp_path, toy_model, "grpo", steps=2, checkpoint={"enabled": False},
                        rewards={"functions": {"tests.support.rl_toy:constant_reward": 1.0}})
    result = train(config, records=toy_prompts(16))
    finite_history(result)
    for row in result.history:
        assert row["groups/zero_variance_fraction"] == 1.0
        assert row["advantages/abs_mean"] == 0.0
        assert row["update_skipped"] == 0.0


def test_an_online_run_whose_rewards_never_vary_stops_as_stalled(tmp_path, toy_model):
    """Every reward the same: zero advantages and (no KL) an exactly zero gradient in every
    update. The engine's stall watch reads that as "no signal", never a stall; the online
    alarm stops the run after train.max_stalled_streak such rollouts."""
    from alignax.trainers.engine.loop import StalledRunError

    config = toy_config(tmp_path, toy_model, "grpo", steps=4, checkpoint={"enabled": False},
                        train={"max_stalled_streak": 2}, grpo={"kl_coef": 0.0},
                        rewards={"functions": {"tests.support.rl_toy:constant_reward": 1.0}})
    with pytest.raises(StalledRunError, match="2 rollouts in a row had an exactly zero gradient"):
        train(config, records=toy_prompts(16))


def test_the_tiny_ppo_recipe_gets_rewards_that_vary_and_trains(tmp_path):
    """configs/tiny-ppo.yaml on its random model: the verifiers alone give every sample 0
    (no answer tag, no digit), so its rewards include length_closeness."""
    from alignax.trainers.api import load_config

    config = load_config("configs/tiny-ppo.yaml", [f"output_dir={tmp_path}", "train.total_steps=1",
                                                   "checkpoint.enabled=false", "data.eval_fraction=0.0",
                                                   "logging.console=false", "logging.tensorboard=false"])
    (row,) = train(config).history
    assert row["reward/answer"] == 0.0 and row["reward/std"] > 0.0
    assert row["reward/fn/alignax.rewards.verifiers:length_closeness"] > 0.0
    assert row["grad_norm"] > 0.0 and row["alarm/no_signal"] == 0.0


def test_an_all_truncated_batch_trains_nothing_and_stays_finite(tmp_path, toy_model):
    # no stop token can be emitted (the stop id is outside the vocabulary) and truncated
    # completions are masked: every row is out of the loss.
    config = toy_config(tmp_path, toy_model, "grpo", steps=2, checkpoint={"enabled": False},
                        rollout={"stop_token_ids": [999]}, rewards={"mask_truncated": True})
    result = train(config, records=toy_prompts(16))
    finite_history(result)
    for row in result.history:
        assert row["response/truncation_rate"] == 1.0
        assert row["loss"] == 0.0 and row["grad_norm"] == 0.0


def test_nan_rewards_are_rejected_with_a_clear_error(tmp_path, toy_model):
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        rewards={"functions": {"tests.support.rl_toy:nan_reward": 1.0}})
    with pytest.raises(NonFiniteRewardError, match="reward component 'fn/tests.support.rl_toy:nan_reward' is nan for completion 0"):
        train(config, records=toy_prompts(16))


def test_a_nan_reward_saves_the_work_before_it_stops_the_run(tmp_path, toy_model):
    from tests.support import rl_toy

    rl_toy.SCORED_BATCHES.clear()
    config = toy_config(tmp_path, toy_model, "grpo", steps=4, data={"eval_fraction": 0.0},
                        rewards={"functions": {"tests.support.rl_toy:nan_on_second_batch": 1.0}})
    with pytest.raises(NonFiniteRewardError, match="is nan for completion 0"):
        train(config, records=toy_prompts(16))
    assert len(rl_toy.SCORED_BATCHES) == 2
    with Checkpointer(str(tmp_path / "checkpoints")) as ckpt:
        assert ckpt.all_steps() == [1]  # the rollout before the NaN is kept
        _, meta = ckpt.restore(make_trainer(config, records=toy_prompts(16)).init_state()[0])
    assert meta["data"] is not None


def test_a_sampler_mesh_over_other_devices_is_refused_naming_the_key(tmp_path, toy_model):
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, rollout={"mesh": [1, 1, 2]})
    with pytest.raises(ValueError, match=r"rollout.mesh=\[1, 1, 2\]: the sampler's mesh spans the same 1 devices"):
        make_trainer(config, records=toy_prompts(16))


def test_stop_token_stays_in_the_mask_when_pad_equals_eos(tmp_path, toy_model):
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        rollout={"max_new_tokens": 24, "num_samples": 8})
    trainer = make_trainer(config, records=toy_prompts(16))
    eos = trainer.tokenizer.eos_token_id
    assert eos == trainer.tokenizer.pad_token_id
    import jax

    batch = next(trainer.data.iterator("train"))
    actors = trainer.actors
    groups, _, _ = actors.sampler.sample(actors.sampling_state(actors.initial_params), batch, jax.random.key(3))
    stopped = np.flatnonzero(groups.stopped)
    assert stopped.size > 0
    for r in stopped:
        length = int(groups.response_mask[r].sum())
        assert groups.tokens[r, length - 1] == eos  # the real end-of-turn token is a response token
        assert np.all(groups.response_mask[r, length:] == 0) and np.all(groups.tokens[r, length:] == eos)


def test_loss_reads_response_tokens_only(tmp_path, toy_model):
    """Prompt padding and the tokens after a completion's end change neither loss nor gradient."""
    import jax
    import jax.numpy as jnp

    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        rollout={"max_new_tokens": 12})
    trainer = make_trainer(config, records=toy_prompts(16))
    params = trainer.actors.initial_params
    rng = np.random.default_rng(0)
    r, n, p = trainer.layout.rows, trainer.actors.max_new, trainer.actors.prompt_len
    prompt_mask = np.ones((r, p), np.int32)
    prompt_mask[:, : p // 2] = 0  # left padding
    response_mask = np.ones((r, n), np.float32)
    response_mask[:, n // 2 :] = 0  # every completion ended halfway
    tokens = rng.integers(4, 20, size=(r, p + n)).astype(np.int32)
    attention = np.concatenate([prompt_mask, response_mask.astype(np.int32)], 1)
    positions = np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32)
    mb = {"tokens": tokens, "positions": positions, "attention_mask": attention, "loss_mask": response_mask,
          "old_logps": np.full((r, n), -2.0, np.float32), "sampler_logps": np.full((r, n), -2.0, np.float32),
          "ref_logps": np.full((r, n), -2.5, np.float32), "advantages": rng.normal(size=(r, n)).astype(np.float32),
          "old_values": np.zeros((r, n), np.float32), "returns": np.zeros((r, n), np.float32)}
    norms = {"num_tokens": response_mask.sum(), "num_seqs": float(r)}
    grad = jax.jit(jax.grad(lambda prm, b: trainer.learner.loss_fn(prm, {}, b, norms, None)[0]))

    def minibatch(fields):
        return Minibatch(rollout=Rollout(**{k: jnp.asarray(v) for k, v in fields.items()}),
                         kl_coef=jnp.asarray(0.04), schedule_position=jnp.asarray(0))

    base = grad(params, minibatch(mb))
    changed = dict(mb)
    noisy = tokens.copy()
    noisy[:, : p // 2] = rng.integers(4, 20, size=(r, p // 2))  # prompt padding
    noisy[:, p + n // 2 :] = rng.integers(4, 20, size=(r, n - n // 2))  # after the completions' end
    changed["tokens"] = noisy
    other = grad(params, minibatch(changed))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
        np.testing.assert_array_equal(a, b)


def test_resume_through_a_rollout_boundary_is_bit_identical(tmp_path, toy_model):
    records = toy_prompts(32)
    full = train(toy_config(tmp_path / "full", toy_model, "grpo", steps=4, checkpoint={"enabled": False}),
                 records=records)  # saves nothing: saving does not touch the steps
    first = train(toy_config(tmp_path / "split", toy_model, "grpo", steps=2), records=records)
    resumed = train(toy_config(tmp_path / "split", toy_model, "grpo", steps=4), records=records)
    assert first.loop.last_step == 2 and [h["step"] for h in resumed.history] == [3, 4]
    for key in ("reward/total", "loss", "grad_norm", "kl/ref_seq", "entropy"):
        assert [h[key] for h in full.history[2:]] == [h[key] for h in resumed.history], key
    ckpt = Checkpointer(str(tmp_path / "split" / "checkpoints"))
    assert ckpt.has_reference() and ckpt.latest_step() == 4
    ckpt.close()


# Settings whose runs tests/test_online_variants.py does not already check against an
# independent computation (it covers DAPO, Dr. GRPO, GSPO, CISPO, RLOO, REINFORCE++,
# ReMax with groups and process advantages): these run end to end here.
VARIANTS = {
    "remax_single_sample": dict(grpo={"advantage": "remax", "policy_loss": "pg"}, rollout={"num_samples": 1}),
    "ppo_shared_critic": dict(ppo={"critic": "shared", "adaptive_kl": True, "kl_target": 0.5, "target_kl": 0.01}),
    "sampler_logps": dict(rollout={"old_logps": "sampler", "top_p": 0.9}),
    "tis": dict(rollout={"tis_cap": 2.0}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_runs(tmp_path, toy_model, variant):
    sections = VARIANTS[variant]
    algorithm = "ppo" if "ppo" in sections else "grpo"
    config = toy_config(tmp_path, toy_model, algorithm, steps=2, checkpoint={"enabled": False}, **sections)
    result = train(config, records=toy_prompts(32))
    finite_history(result)
    last = result.history[-1]
    if variant == "remax_single_sample":
        assert "reward/greedy_baseline" in last
    if variant == "ppo_shared_critic":  # the epochs the target KL lets run: test_target_kl_stops_...
        assert "value/loss" in last and "value/explained_variance" in last
    if variant == "tis":
        assert last["mismatch/sampler_trainer_abs"] > 0.0 and "tis_weight_mean" in last


def observed_update(trainer):
    """``(rollout batch, update result, [(minibatch rollout, step output)] on the host)`` of
    one rollout of ``trainer`` through its seams: collect, then learn with an observer."""
    import jax

    state, frozen = trainer.start()
    batches = trainer.data.iterator("train")
    seen = []
    batch = trainer.collect(state, frozen, next(batches), batches)
    _, result = trainer.learn(state, frozen, batch,
                              observe=lambda mb, out: seen.append(jax.device_get((mb.rollout, out))))
    return batch, result, seen


def test_sampler_old_logps_are_the_ratios_denominator(tmp_path, toy_model):
    """rollout.old_logps=sampler: the update's old log-probs are the sampler's, bit for bit,
    and the loss's importance ratio is exp(trainer - sampler log-prob) over the loss tokens,
    away from 1 (top_p=0.9 renormalises the sampler's distribution; with recomputed old
    log-probs the single update's ratio is exactly 1)."""
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        rollout={"old_logps": "sampler", "top_p": 0.9})
    _, _, seen = observed_update(make_trainer(config, records=toy_prompts(16)))
    (ro, out), = seen
    np.testing.assert_array_equal(ro.old_logps, ro.sampler_logps)
    ratio = np.exp(np.asarray(out.rows.logps, np.float64) - ro.sampler_logps)[ro.loss_mask > 0]
    np.testing.assert_allclose(out.metrics["ratio_mean"], ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["ratio_max"], ratio.max(), rtol=1e-5)
    assert abs(ratio.mean() - 1) > 1e-3


def test_target_kl_ends_the_epochs_after_the_first_one_over_one_and_a_half_targets(tmp_path, toy_model):
    """PPO's target KL: every epoch that ran but the last has mean approx KL <= 1.5 x target,
    and the epochs end early only after one above it; ``epochs_run`` counts them."""
    epochs, minibatches, target = 4, 2, 0.01
    config = toy_config(tmp_path, toy_model, "ppo", steps=1, checkpoint={"enabled": False},
                        ppo={"critic": "shared", "epochs": epochs, "minibatches": minibatches, "target_kl": target},
                        rewards={"functions": {"tests.support.rl_toy:hashed_reward": 1.0}})
    _, result, seen = observed_update(make_trainer(config, records=toy_prompts(16)))
    assert len(seen) == result.epochs_run * minibatches == len(result.metrics)
    over = [np.mean([out.metrics["approx_kl"] for _, out in seen[e * minibatches:(e + 1) * minibatches]])
            > 1.5 * target for e in range(result.epochs_run)]
    assert not any(over[:-1])
    assert result.epochs_run == epochs or over[-1]
    assert 1 < result.epochs_run < epochs, over  # these settings stop part-way: the rule was exercised


@pytest.fixture(scope="module")
def toy_reward_model(tmp_path_factory, toy_model):
    """A reward model trained (briefly) on the toy model and exported as an HF folder."""
    from alignax.trainers.api import export
    from alignax.trainers.api import train as train_offline
    from tests.support.trainer_helpers import separable_pairs, tiny_config

    tmp = tmp_path_factory.mktemp("toy-reward")
    config = tiny_config(tmp, "reward", steps=4, model_dir=toy_model)
    train_offline(config, records=separable_pairs(32))
    return export(config, str(tmp / "export"))


@pytest.mark.xdist_group("toy-reward-model")  # shares the module fixture: one worker builds it
def test_ppo_critic_from_a_reward_model_ensemble_and_ptx(tmp_path, toy_model, toy_reward_model):
    from alignax.data import write_jsonl
    from tests.support.trainer_helpers import sft_conversations

    ptx_path = tmp_path / "ptx.jsonl"
    write_jsonl(sft_conversations(16), ptx_path)
    ptx = {"paths": [str(ptx_path)], "format": "sft", "max_length": 32, "max_prompt_length": 24, "batch_size": 4,
           "read_threads": 0}
    # rewards from an ensemble of reward models (two copies of one: they agree); the
    # ensemble's rules against NumPy on two that disagree: tests/test_online_variants.py
    config = toy_config(tmp_path, toy_model, "ppo", steps=2, checkpoint={"enabled": False},
                        ppo={"critic_init": "reward_model", "critic_path": toy_reward_model, "ptx_coef": 0.5,
                             "ptx_data": ptx},
                        rewards={"functions": {}, "reward_models": [toy_reward_model, toy_reward_model],
                                 "ensemble": "mean_minus_std", "ensemble_k": 1.0})
    result = train(config, records=toy_prompts(16))
    finite_history(result)
    last = result.history[-1]
    assert "reward/reward_model" in last and last["reward/reward_model_std"] == 0.0  # two copies agree
    np.testing.assert_allclose(last["reward/total"], last["reward/reward_model"], rtol=1e-6)
    assert "ptx/loss" in last and last["ptx/loss"] > 0
    # the critic starts from the reward model's head, so its first values are not all zero
    assert result.history[0]["value/values_mean"] != 0.0


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_packed_groups_give_the_unpacked_step(toy_model, grad_accum_steps):
    """rollout.pack_groups (auto here packs) runs each group's 4 completions as one row with
    the prompt once; the rollout step (reference log-probs, update, figures) is the unpacked one."""
    import jax

    runs = {"on": one_rollout_step(toy_model, grad_accum_steps), "off": one_rollout_step(toy_model, grad_accum_steps,
                                                                                          pack="off")}
    (params_a, fig_a), (params_b, fig_b) = runs["on"], runs["off"]
    assert fig_a["reward/total"] == fig_b["reward/total"]
    for key in ("loss", "grad_norm", "entropy", "kl/ref_seq", "kl/ref_k3", "mismatch/sampler_trainer_abs",
                "approx_kl", "advantages/abs_mean"):
        np.testing.assert_allclose(fig_a[key], fig_b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_group_packing_decision(tmp_path, toy_model):
    records = toy_prompts(16)

    def group(**sections):
        trainer = make_trainer(toy_config(tmp_path, toy_model, "grpo", steps=1, **sections), records=records)
        return trainer.actors.pack_group

    # toy shapes: prompt 24, 8 new tokens, G = 4: one row of 56 tokens instead of 4 of 32
    assert group() == 4
    # 64 new tokens, G = 8: rows of 536 tokens, whose attention outweighs the saved prompts
    assert group(rollout={"num_samples": 8, "max_new_tokens": 64}) == 1
    assert group(rollout={"num_samples": 8, "max_new_tokens": 64, "pack_groups": "on"}) == 8
    assert group(rollout={"pack_groups": "off"}) == 1
    # minibatches of whole groups, drawn group by group
    trainer = make_trainer(toy_config(tmp_path, toy_model, "grpo", steps=1, grpo={"minibatches": 2}),
                           records=records)
    parts = trainer.learner.minibatch_rows(np.random.default_rng(0))
    assert len(parts) == 2 and sorted(np.concatenate(parts).tolist()) == list(range(16))
    for rows in parts:
        by_group = rows.reshape(-1, 4)
        assert (by_group == by_group[:, :1] + np.arange(4)).all() and (by_group[:, 0] % 4 == 0).all()
    with pytest.raises(ValueError, match="pack_groups=on needs whole groups"):
        group(rollout={"pack_groups": "on"}, grpo={"minibatches": 8})  # 4 prompts, 8 minibatches


def test_lr_schedule_follows_the_rollouts_when_target_kl_stops_epochs_early(tmp_path, toy_model):
    """The learning rate of rollout k's j-th update is read at k * epochs * minibatches + j:
    epochs skipped by the target KL neither stretch nor cut the schedule."""
    lr, epochs, minibatches, steps = 2e-2, 4, 2, 2
    config = toy_config(tmp_path, toy_model, "ppo", steps=steps, checkpoint={"enabled": False},
                        optim={"learning_rate": lr, "schedule": "linear", "warmup_steps": 0},
                        ppo={"epochs": epochs, "minibatches": minibatches, "target_kl": 1e-9},
                        rewards={"functions": {"tests.support.rl_toy:hashed_reward": 1.0}})
    result = train(config, records=toy_prompts(16))
    total = steps * epochs * minibatches
    for k, row in enumerate(result.history):
        assert row["epochs_run"] == 1  # the second minibatch is off-policy: the tiny target stops the epochs
        positions = [k * epochs * minibatches + j for j in range(minibatches)]
        expected = np.mean([lr * (1 - p / total) for p in positions])
        np.testing.assert_allclose(row["learning_rate"], expected, rtol=1e-6)
