"""What each online-RL variant changes, measured on the real trainer.

Every run builds the trainer on the toy word-level model (tests/support/toy_model.py) with the same
records and seed, runs one or two rollout steps, and records what the trainer computed: the
advantage inputs and outputs of each rollout, and each update's minibatch, metrics and
per-row log-probs. The rollout depends only on the policy and the seed, so every GRPO
variant sees the same samples as the default GRPO ("base"), and each one is checked against

(a) its paper's formula, in NumPy, on the rollout's own rewards (advantages), or on the
    update's own log-probs (losses and clip fractions); and
(b) the default's first update, which it must change by a clear margin.

The reward is a hash of the completion text, so every group's rewards vary and no variant
can pass on zero advantages; the frozen reference is perturbed, so the KL to it is far from
0 from the first rollout on. PPO's runs each combine a few features whose checks do not
interfere (e.g. a tiny target KL with the KL in the loss), to keep the file fast.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.losses import cispo_policy_loss, gspo_policy_loss, pg_loss, ppo_policy_loss
from alignax.trainers.api import build_trainer, train
from alignax.trainers.api import load_config
from alignax.trainers.online import grpo as grpo_family
from alignax.trainers.online import ppo as ppo_family
from tests.support.rl_toy import hashed_reward, toy_config, toy_prompts
from tests.support.trainer_helpers import perturbed

# The runs are shared by the tests of this file (a module fixture): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("online_variants")

RECORDS = toy_prompts(32)  # 24 train prompts: 6 rollouts of 4 prompts
HASHED = {"functions": {"tests.support.rl_toy:hashed_reward": 1.0}}
NEW_TOKENS = 8  # toy_config's rollout.max_new_tokens


# ----------------------------------------------------------------------------- rewards


def gated_reward(completions, references):
    """0 for every completion of a prompt containing the word "no" (a zero-variance group),
    else :func:`hashed_reward`."""
    hashed = hashed_reward(completions, references)
    return [0.0 if "no" in ref["prompt"].split() else h for h, ref in zip(hashed, references)]


def step_words(steps, references):
    """Process reward: each step earns its word count plus half its index."""
    del references
    return [[len(text.split()) + 0.5 * j for j, text in enumerate(parts)] for parts in steps]


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Run:
    """What a run computed, on the host."""

    trainer: Any
    params0: Any  # before the first update
    params: list[Any]  # after each rollout step
    figures: list[dict[str, float]]  # per rollout step
    inputs: list[dict[str, np.ndarray]]  # AdvantageInputs per rollout step
    advantages: list[np.ndarray]
    returns: list[np.ndarray]
    updates: list[dict[str, Any]]  # per update: minibatch rollout, metrics, rows (logps)
    prompt_batch: Any


REF_NOISE = 0.05


def run_steps(tmp_path, toy_model, algorithm: str, *, steps: int = 1, ref_noise: float = REF_NOISE,
              records=RECORDS, **sections) -> Run:
    sections = {**sections, "rewards": {**HASHED, **sections.get("rewards", {})}}
    config = toy_config(tmp_path, toy_model, algorithm, steps=steps, checkpoint={"enabled": False}, **sections)
    trainer = build_trainer(config, records=records)
    inputs, advantages, returns, updates = [], [], [], []

    def record_update(minibatch, out):  # each step's minibatch and output, through the update's observer
        host_mb = jax.device_get(minibatch)
        updates.append({"rollout": host_mb.rollout, "ptx": host_mb.ptx, "metrics": jax.device_get(out.metrics),
                        "logps": np.asarray(out.rows.logps), "entropy": np.asarray(out.rows.entropy)})

    state, frozen = trainer.start()
    if ref_noise and "reference" in frozen:
        frozen["reference"] = perturbed(frozen["reference"], scale=ref_noise, seed=1)
    params0 = jax.device_get(state.params)
    batches = trainer.data.iterator("train")
    figures, params, prompt_batch = [], [], None
    for _ in range(steps):
        batch = next(batches)
        prompt_batch = prompt_batch or batch
        # the trainer's seams in turn: collect, learn, figures (what rollout_step runs)
        rollout = trainer.collect(state, frozen, batch, batches)
        inputs.append({k: None if v is None else np.asarray(v)
                       for k, v in dataclasses.asdict(jax.device_get(rollout.inputs)).items()})
        advantages.append(np.asarray(rollout.rollout.advantages))
        returns.append(np.asarray(rollout.rollout.returns))
        state, result = trainer.learn(state, frozen, rollout, observe=record_update)
        figures.append(trainer.figures(rollout, result))
        params.append(jax.device_get(state.params))
    return Run(trainer, params0, params, figures, inputs, advantages, returns, updates, prompt_batch)


SGD = {"name": "sgd", "learning_rate": 2e-2, "max_grad_norm": None, "schedule": "constant"}

# Every run with a reference gets a perturbed one (REF_NOISE), so the KL is far from 0 from
# the first rollout on, and every comparison between runs has the same KL term.
GRPO_RUNS = {
    # the default GRPO: its first update is the default's (the adaptive controller only acts
    # after it, on the coefficient the next rollout uses)
    "base": dict(steps=2, grpo={"adaptive_kl": True, "kl_target": 1e-3, "kl_horizon": 16.0}),
    "dr_grpo": dict(grpo={"advantage": "dr_grpo", "aggregation": "seq-mean-token-sum-norm"}),
    "rloo": dict(grpo={"advantage": "rloo", "policy_loss": "pg"}),
    "reinforce_pp": dict(grpo={"advantage": "reinforce_pp", "policy_loss": "pg"}),
    "reinforce_pp_baseline": dict(grpo={"advantage": "reinforce_pp", "reinforce_baseline": True, "policy_loss": "pg"}),
    "remax": dict(grpo={"advantage": "remax", "policy_loss": "pg"}),
    "process": dict(grpo={"advantage": "process", "step_delimiter": "no",
                          "process_reward": "tests.test_online_variants:step_words"}),
    "dapo": dict(grpo={"policy_loss": "ppo", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "aggregation": "token-mean",
                       "dynamic_sampling": True, "kl_coef": 0.0},
                 rewards={"functions": {"tests.test_online_variants:gated_reward": 1.0}}),
    "kl_reward": dict(grpo={"kl_placement": "reward", "kl_kind": "k1"}),
    # off-policy updates (a second epoch), where the clip ranges act; clip keys left out
    "gspo_2epochs": dict(grpo={"epochs": 2, "policy_loss": "gspo"}),
    "cispo_2epochs": dict(grpo={"epochs": 2, "policy_loss": "cispo"}),
    # the KL's importance weight: off-policy in the second epoch, on-policy in one
    "epochs2": dict(grpo={"epochs": 2}),
    "epochs2_kl_detached": dict(grpo={"epochs": 2, "kl_importance_weight": "detached_ratio"}),
    "kl_ratio": dict(grpo={"kl_importance_weight": "ratio"}),
    # off-policy sequence masking at threshold 0: the second epoch drops every negative-advantage
    # token of a completion the policy has moved away from
    # a threshold just above float32 noise: the first update's recomputed pi_old and its own
    # log-probs come from two compiled programs and may differ in the last bits (one read from
    # the compilation cache, one compiled fresh), which a threshold of exactly 0 would count
    "epochs2_opsm": dict(grpo={"epochs": 2, "off_policy_mask_threshold": 1e-5}),
    "scale_batch": dict(grpo={"scale_rewards": "batch"}),
    "top_entropy": dict(grpo={"top_entropy_quantile": 0.2}),
    "sapo_2epochs": dict(grpo={"epochs": 2, "policy_loss": "sapo"}),
}

PPO_RUNS = {
    # 4 epochs of 2 minibatches, no target KL, dual clip and clip-higher on; KL (k1) in the
    # reward; the adaptive controller told the KL is far above target
    "reward_up": dict(steps=2, ppo={"epochs": 4, "minibatches": 2, "dual_clip_c": 3.0, "clip_eps_high": 0.28,
                                    "adaptive_kl": True, "kl_target": 1e-4, "kl_horizon": 8.0}),
    # the same with a tiny target KL, the KL in the loss, and a KL target far above the KL
    "loss_down": dict(ppo={"epochs": 4, "minibatches": 2, "target_kl": 1e-6, "kl_placement": "loss",
                           "adaptive_kl": True, "kl_target": 1e4, "kl_horizon": 8.0}),
    # PPO-ptx, one SGD update (-lr * g, no clipping); with 2 micro-batches and the critic's own
    # learning rate (neither changes the gradient; only the latter changes the step)
    "ptx": dict(ptx=True, optim=SGD, ppo={"epochs": 1, "minibatches": 1}),
    "ptx_accum2_critic_lr": dict(ptx=True, optim=SGD, train={"grad_accum_steps": 2},
                                 ppo={"epochs": 1, "minibatches": 1, "critic_learning_rate": 5e-2}),
}


def ptx_data(directory) -> dict:
    from alignax.data import write_jsonl
    from tests.support.trainer_helpers import sft_conversations

    path = directory / "ptx.jsonl"
    write_jsonl(sft_conversations(16), path)
    return {"ptx_coef": 0.5, "ptx_data": {"paths": [str(path)], "format": "sft", "max_length": 32,
                                          "max_prompt_length": 24, "batch_size": 4, "read_threads": 0}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_model):
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            algorithm, spec = ("ppo", PPO_RUNS[name]) if name in PPO_RUNS else ("grpo", GRPO_RUNS[name])
            spec = dict(spec)
            directory = tmp_path_factory.mktemp(name)
            if spec.pop("ptx", False):
                spec["ppo"] = {**spec["ppo"], **ptx_data(directory)}
            cache[name] = run_steps(directory, toy_model, algorithm, **spec)
        return cache[name]

    return get


# ----------------------------------------------------------------------------- NumPy references


def groups_of(x, group_size=4):
    return np.asarray(x, np.float64).reshape(-1, group_size)


def agg_np(per_token, mask, mode, norm_length=NEW_TOKENS):
    per_token, mask = np.asarray(per_token, np.float64), np.asarray(mask, np.float64)
    lengths = mask.sum(1)
    seqs = max((lengths > 0).sum(), 1)
    sums = (per_token * mask).sum(1)
    if mode == "token-mean":
        return sums.sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return (sums / np.maximum(lengths, 1)).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        return sums.sum() / (seqs * norm_length)
    raise ValueError(mode)


def sequence_advantages(run: Run, step: int = 0) -> np.ndarray:
    """The per-sequence advantage of each row (the advantages are constant along a row)."""
    adv, mask = run.advantages[step], run.inputs[step]["loss_mask"]
    per_row = adv.sum(1) / np.maximum(mask.sum(1), 1)
    np.testing.assert_allclose(adv, per_row[:, None] * mask, rtol=1e-6, atol=1e-7)
    return per_row


def params_delta(run: Run):
    """What the first rollout step's updates did to the parameters."""
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), run.params[0],
                        run.params0)


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_same_rollout(run: Run, other: Run):
    np.testing.assert_array_equal(run.inputs[0]["loss_mask"], other.inputs[0]["loss_mask"])
    np.testing.assert_array_equal(run.inputs[0]["rewards"], other.inputs[0]["rewards"])


def assert_update_differs(run: Run, default: Run):
    """The first update moved the policy differently from the default's (Adam's first step
    moves each entry by about lr = 2e-2 times the sign of its gradient)."""
    assert max_abs_diff(params_delta(run), params_delta(default)) > 1e-2
    assert not math.isclose(run.figures[0]["grad_norm"], default.figures[0]["grad_norm"], rel_tol=1e-2)


def first_update_pg_loss(run: Run, kind: str, mode: str) -> float:
    """The policy term of the single on-policy update (ratio exactly 1) from its own log-probs."""
    update = run.updates[0]
    ro = update["rollout"]
    adv, mask, logps = ro.advantages, ro.loss_mask, update["logps"]
    per_token = -adv if kind == "ratio" else -adv * logps  # ppo/gspo: -A r; pg/cispo: -A w logp, w = 1
    return agg_np(per_token, mask, mode)


# ----------------------------------------------------------------------------- default GRPO


def test_default_grpo_advantages_are_group_normalised(runs):
    run = runs("base")
    rewards = groups_of(run.inputs[0]["rewards"])
    assert np.all(rewards.std(1) > 0)  # the hashed reward: every group varies
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(groups_of(sequence_advantages(run)), expected, rtol=1e-5, atol=1e-6)
    assert run.figures[0]["first_minibatch/ratio_min"] == run.figures[0]["first_minibatch/ratio_max"] == 1.0
    # the PPO term at ratio 1 with seq-mean-token-mean is -mean_i A_i: zero for normalised groups
    np.testing.assert_allclose(run.updates[0]["metrics"]["pg_loss"],
                               first_update_pg_loss(run, "ratio", "seq-mean-token-mean"), atol=1e-6)


# ----------------------------------------------------------------------------- advantage variants


def test_scale_rewards_batch_divides_by_the_rollouts_std(runs):
    """``grpo.scale_rewards: batch`` (TRL's key): the group-centred rewards over the std of
    every reward of the rollout, so the update differs from the default's."""
    run, base = runs("scale_batch"), runs("base")
    assert_same_rollout(run, base)
    rewards = groups_of(run.inputs[0]["rewards"])
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(groups_of(sequence_advantages(run)), expected, rtol=1e-4, atol=1e-5)
    assert not np.allclose(sequence_advantages(run), sequence_advantages(base), atol=1e-3)
    assert_update_differs(run, base)


def test_dr_grpo_drops_the_std_and_normalises_by_the_budget(runs):
    run, default = runs("dr_grpo"), runs("base")
    assert_same_rollout(run, default)
    rewards = groups_of(run.inputs[0]["rewards"])
    expected = rewards - rewards.mean(1, keepdims=True)  # Liu et al. 2025: no division by std
    np.testing.assert_allclose(groups_of(sequence_advantages(run)), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(groups_of(sequence_advantages(run)), groups_of(sequence_advantages(default)), atol=1e-2)
    # seq-mean-token-sum-norm: sum_i A_i L_i / (B * max_new_tokens), not zero like the default's
    metrics = run.updates[0]["metrics"]
    expected_pg = first_update_pg_loss(run, "ratio", "seq-mean-token-sum-norm")
    np.testing.assert_allclose(metrics["pg_loss"], expected_pg, rtol=1e-4, atol=1e-7)
    assert abs(expected_pg) > 1e-3
    assert_update_differs(run, default)


def test_rloo_uses_the_leave_one_out_baseline(runs):
    run, default = runs("rloo"), runs("base")
    assert_same_rollout(run, default)
    rewards = groups_of(run.inputs[0]["rewards"])
    g = rewards.shape[1]
    loo = (rewards.sum(1, keepdims=True) - rewards) / (g - 1)  # mean of the other samples
    np.testing.assert_allclose(groups_of(sequence_advantages(run)), rewards - loo, rtol=1e-5, atol=1e-6)
    assert run.trainer.algorithm.objective.loss_fn is pg_loss and run.trainer.algorithm.objective.keywords == {}
    metrics = run.updates[0]["metrics"]
    np.testing.assert_allclose(metrics["pg_loss"], first_update_pg_loss(run, "logp", "seq-mean-token-mean"),
                               rtol=1e-4, atol=1e-6)
    assert metrics["clipfrac_low"] == metrics["clipfrac_high"] == 0.0
    assert_update_differs(run, default)


def test_reinforce_pp_whitens_over_the_batch(runs):
    run, default = runs("reinforce_pp"), runs("base")
    assert_same_rollout(run, default)
    r = np.asarray(run.inputs[0]["rewards"], np.float64)
    expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)  # Hu 2025: global, not per group
    adv = sequence_advantages(run)
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(groups_of(adv).sum(1))) > 0.1  # groups are not centred
    assert_update_differs(run, default)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_over_the_batch(runs):
    run, plain = runs("reinforce_pp_baseline"), runs("reinforce_pp")
    assert_same_rollout(run, plain)
    rewards = groups_of(run.inputs[0]["rewards"])
    centred = (rewards - rewards.mean(1, keepdims=True)).reshape(-1)
    expected = centred / (centred.std(ddof=1) + 1e-6)
    adv = sequence_advantages(run)
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(groups_of(adv).sum(1), 0.0, atol=1e-5)
    assert not np.allclose(adv, sequence_advantages(plain), atol=1e-2)
    assert_update_differs(run, runs("base"))


def test_remax_subtracts_the_greedy_completions_reward(runs):
    run, default = runs("remax"), runs("base")
    assert_same_rollout(run, default)
    trainer = run.trainer
    # the greedy completion of each prompt under the starting policy, scored independently
    greedy, _, _ = trainer.actors.sampler.sample(trainer.actors.sampling_state(jax.tree.map(jnp.asarray, run.params0)),
                                          run.prompt_batch, jax.random.key(0), config=trainer.actors.greedy)
    greedy_rewards = np.asarray(hashed_reward(greedy.completions, None), np.float64)
    assert np.all(greedy_rewards > 0)  # a real baseline, not the zeros of no baseline
    baseline = np.repeat(greedy_rewards, trainer.layout.group_size)
    np.testing.assert_allclose(run.inputs[0]["baseline"], baseline, rtol=1e-6)
    np.testing.assert_allclose(sequence_advantages(run), run.inputs[0]["rewards"] - baseline, rtol=1e-5, atol=1e-6)
    assert run.figures[0]["reward/greedy_baseline"] == pytest.approx(greedy_rewards.mean(), rel=1e-6)
    assert "reward/greedy_baseline" not in default.figures[0]
    assert_update_differs(run, default)


def expected_process(run: Run):
    """Step ends (a token whose text contains the delimiter, and the last token), step rewards
    (``step_words`` of each step's text) and DeepSeekMath's process advantages, in NumPy."""
    trainer = run.trainer
    ro = run.updates[0]["rollout"]
    response = np.asarray(ro.tokens)[:, trainer.actors.prompt_len:]
    mask = np.asarray(ro.loss_mask)
    rows, n = mask.shape
    step_mask = np.zeros((rows, n))
    step_rewards = np.zeros((rows, n))
    for r in range(rows):
        length = int(mask[r].sum())
        ends = [t for t in range(length) if "no" in trainer.tokenizer.decode([int(response[r, t])])]
        if length and (not ends or ends[-1] != length - 1):
            ends.append(length - 1)
        start = 0
        for j, end in enumerate(ends):
            text = trainer.tokenizer.decode(response[r, start:end + 1].tolist(), skip_special_tokens=True)
            step_mask[r, end] = 1
            step_rewards[r, end] = len(text.split()) + 0.5 * j
            start = end + 1
    normed = np.zeros((rows, n))
    g = trainer.layout.group_size
    for first in range(0, rows, g):
        block = slice(first, first + g)
        values = step_rewards[block][step_mask[block] > 0]
        if values.size < 2 or values.max() == values.min():
            continue
        z = (step_rewards[block] - values.mean()) / (values.std(ddof=1) + 1e-6)
        normed[block] = np.where(step_mask[block] > 0, z, 0.0)
    advantages = np.cumsum(normed[:, ::-1], axis=1)[:, ::-1] * mask  # sum over steps ending at or after t
    return step_mask, step_rewards, advantages


def test_process_advantages_sum_the_normalised_rewards_of_later_steps(runs):
    run, default = runs("process"), runs("base")
    assert_same_rollout(run, default)
    step_mask, step_rewards, advantages = expected_process(run)
    np.testing.assert_array_equal(run.inputs[0]["step_mask"], step_mask)
    np.testing.assert_allclose(run.inputs[0]["step_rewards"], step_rewards, rtol=1e-6)
    np.testing.assert_allclose(run.advantages[0], advantages, rtol=1e-5, atol=1e-5)
    assert step_mask.sum() > step_mask.shape[0]  # some completion has more than one step
    # dense: the advantage changes along a row at step ends (outcome advantages never do)
    mask = run.inputs[0]["loss_mask"] > 0
    varying = [np.ptp(a[m]) > 1e-3 for a, m in zip(run.advantages[0], mask) if m.any()]
    assert any(varying)
    assert run.figures[0]["process/steps_per_completion"] == pytest.approx(step_mask.sum() / step_mask.shape[0])
    assert_update_differs(run, default)


# ----------------------------------------------------------------------------- DAPO


def test_dapo_clip_higher_token_mean_and_dynamic_sampling(runs):
    run = runs("dapo")
    algo = run.trainer.algorithm
    assert algo.objective.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
    assert algo.objective.aggregation == "token-mean"
    assert not run.trainer.algorithm.kl.uses_reference  # kl_coef 0: no reference model at all
    # ... so no reference log-probs reach the advantages or the update, no KL figures are
    # reported (a KL against zeros would be minus the policy's log-probs), and the KL alarm
    # is never fed (its other alarms are)
    assert run.inputs[0]["ref_logps"] is None and run.updates[0]["rollout"].ref_logps is None
    assert not [k for k in run.figures[0] if k.startswith("kl/")]
    assert run.trainer.alarms.state()["kl"] == [] and len(run.trainer.alarms.state()["length"]) == 1
    assert run.figures[0]["alarm/kl_acceleration"] == 0.0 and run.figures[0]["kl_coef"] == 0.0
    # clip-higher: a ratio of 1.25 on a positive advantage is inside DAPO's 1 + 0.28, outside 1 + 0.2
    _, metrics, _ = objective_metrics(algo, np.log([[1.25, 1.25]]), [[1.0, -1.0]])
    assert metrics["clipfrac_high"] == 0.0
    _, metrics, _ = objective_metrics(grpo_algorithm(), np.log([[1.25, 1.25]]), [[1.0, -1.0]])
    assert metrics["clipfrac_high"] == 0.5
    # dynamic sampling: the first prompt batch has zero-variance groups (prompts with "no");
    # DAPO refills from the next batches until it has 4 groups whose rewards vary
    gated = ["no" in ref["prompt"].split() for ref in run.prompt_batch["references"]]
    assert 0 < sum(gated) < 4
    assert run.figures[0]["groups/zero_variance_fraction"] == 0.0
    assert run.figures[0]["groups/refills"] >= 1
    assert run.figures[0]["groups/sampled"] == 4 * (1 + run.figures[0]["groups/refills"])
    assert np.all(groups_of(run.inputs[0]["rewards"]).std(1) > 0)
    # the refills are the next prompt batches: how many it takes, counted from the data
    batches = run.trainer.data.iterator("train")
    informative, needed = 0, -1
    while informative < 4:
        informative += sum("no" not in ref["prompt"].split() for ref in next(batches)["references"])
        needed += 1
    assert run.figures[0]["groups/refills"] == needed
    # token-mean: every token weighs the same, -sum_i A_i L_i / sum_i L_i at ratio 1
    metrics = run.updates[0]["metrics"]
    expected_pg = first_update_pg_loss(run, "ratio", "token-mean")
    np.testing.assert_allclose(metrics["pg_loss"], expected_pg, rtol=1e-4, atol=1e-7)
    assert abs(expected_pg) > 1e-3
    assert "kl" not in metrics


# ----------------------------------------------------------------------------- clip ranges


def grpo_algorithm(**grpo):
    return grpo_family.build_algorithm(load_config(data={"algorithm": "grpo", "data": {"format": "prompt"},
                                                         "grpo": grpo}))


def crafted(log_ratio, advantages):
    """``(logps, old_logps, advantages, mask)`` with the given per-token log-ratios."""
    log_ratio = jnp.asarray(log_ratio, jnp.float32)
    old = jnp.full(log_ratio.shape, -2.0, jnp.float32)
    return old + log_ratio, old, jnp.asarray(advantages, jnp.float32), jnp.ones(log_ratio.shape, jnp.float32)


def objective_metrics(algo, log_ratio, advantages, aggregation="token-mean"):
    logps, old, adv, mask = crafted(log_ratio, advantages)
    objective = algo.objective

    def loss(lp):
        return objective.loss_fn(lp, old, adv, mask, **objective.keywords, aggregation=aggregation)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logps)
    return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def test_gspo_takes_its_papers_clip_band_when_the_keys_are_left_out():
    algo = grpo_algorithm(policy_loss="gspo")
    assert algo.objective.loss_fn is gspo_policy_loss and dict(algo.objective.keywords) == {}
    # 4 sequences of 2 tokens with sequence ratios 1+3.5e-4, 1+4.5e-4 (A > 0), 1-2.5e-4, 1-3.5e-4 (A < 0)
    ratios = np.array([1 + 3.5e-4, 1 + 4.5e-4, 1 - 2.5e-4, 1 - 3.5e-4])
    log_ratio = np.repeat(np.log(ratios)[:, None], 2, axis=1)
    adv = np.array([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    _, metrics, grad = objective_metrics(algo, log_ratio, adv, aggregation="seq-mean-token-mean")
    assert metrics["clipfrac_high"] == pytest.approx(0.25) and metrics["clipfrac_low"] == pytest.approx(0.25)
    assert np.all(grad[[1, 3]] == 0) and np.all(grad[[0, 2]] != 0)  # the clipped sequences get no gradient
    # PPO-clip's 0.2 would clip none of them
    _, ppo_metrics, _ = objective_metrics(grpo_algorithm(), log_ratio, adv, aggregation="seq-mean-token-mean")
    assert ppo_metrics["clipfrac_high"] == ppo_metrics["clipfrac_low"] == 0.0


def test_gspo_with_clip_eps_low_null_keeps_the_papers_lower_bound():
    algo = grpo_algorithm(policy_loss="gspo", clip_eps_low=None, clip_eps_high=5e-4)
    assert dict(algo.objective.keywords) == {"clip_eps_high": 5e-4}
    ratios = np.array([1 + 4.5e-4, 1 + 5.5e-4, 1 - 2.5e-4, 1 - 3.5e-4])
    log_ratio = np.repeat(np.log(ratios)[:, None], 2, axis=1)
    adv = np.array([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]])
    _, metrics, _ = objective_metrics(algo, log_ratio, adv, aggregation="seq-mean-token-mean")
    assert metrics["clipfrac_high"] == pytest.approx(0.25)  # only 1+5.5e-4 is above 1+5e-4
    assert metrics["clipfrac_low"] == pytest.approx(0.25)  # 1-3.5e-4 is below the default 1-3e-4


def test_cispo_takes_its_papers_clip_when_the_keys_are_left_out():
    algo = grpo_algorithm(policy_loss="cispo")
    assert algo.objective.loss_fn is cispo_policy_loss and dict(algo.objective.keywords) == {}
    ratios = np.array([0.5, 0.5, 1.27, 1.29, 1.29, 3.0])
    adv = np.array([1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    _, metrics, grad = objective_metrics(algo, np.log(ratios)[None], adv[None])
    assert metrics["clipfrac_low"] == 0.0  # no lower clip: 0.5 is kept as is
    assert metrics["clipfrac_high"] == pytest.approx(3 / 6)  # above 1.28, whatever the sign of A
    # every token keeps its gradient -w A / N with w = min(r, 1.28)
    weight = np.minimum(ratios, 1.28)
    np.testing.assert_allclose(grad[0], -weight * adv / 6, rtol=1e-5)
    _, ppo_metrics, _ = objective_metrics(grpo_algorithm(), np.log(ratios)[None], adv[None])
    assert ppo_metrics["clipfrac_low"] > 0  # PPO-clip 0.2 would clip 0.5 for A < 0


def test_gspo_and_cispo_clip_the_off_policy_epoch_in_the_trainer(runs):
    """Second epoch: ratios have moved. With the clip keys left out, GSPO clips whole
    sequences outside [1-3e-4, 1+4e-4] and CISPO's weights at 1.28 with no lower clip, as
    their formulas say on the update's own log-probs; PPO-clip's 0.2 would clip far fewer."""
    gspo, cispo, base = runs("gspo_2epochs"), runs("cispo_2epochs"), runs("base")
    for run in (gspo, cispo):
        assert_same_rollout(run, base)
        assert len(run.updates) == 2
        assert dict(run.trainer.algorithm.objective.keywords) == {}
        # the first update is on-policy (ratio 1): GSPO's and CISPO's gradient is then PPO's
        assert run.updates[0]["metrics"]["grad_norm"] == pytest.approx(base.figures[0]["grad_norm"], rel=1e-4)

    def second(run):
        u = run.updates[1]
        ro, mask = u["rollout"], u["rollout"].loss_mask > 0
        log_ratio = np.where(mask, u["logps"] - ro.old_logps, 0.0).astype(np.float64)
        return u, ro.advantages, mask, log_ratio

    def ppo_clipped(adv, ratio, mask):
        return np.mean(((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8)), where=mask)

    u, adv, mask, log_ratio = second(gspo)
    seq = np.exp(log_ratio.sum(1) / np.maximum(mask.sum(1), 1))[:, None] * np.ones_like(log_ratio)
    high = np.mean((adv > 0) & (seq > 1 + 4e-4), where=mask)
    low = np.mean((adv < 0) & (seq < 1 - 3e-4), where=mask)
    assert u["metrics"]["clipfrac_high"] == pytest.approx(high, abs=1e-6)
    assert u["metrics"]["clipfrac_low"] == pytest.approx(low, abs=1e-6)
    assert high + low > 0.3
    assert high + low > ppo_clipped(adv, np.exp(log_ratio), mask) + 0.1
    per_token = np.maximum(-adv * seq, -adv * np.clip(seq, 1 - 3e-4, 1 + 4e-4))
    np.testing.assert_allclose(u["metrics"]["pg_loss"], agg_np(per_token, mask, "seq-mean-token-mean"),
                               rtol=1e-4, atol=1e-6)

    u, adv, mask, log_ratio = second(cispo)
    ratio = np.exp(log_ratio)
    assert u["metrics"]["clipfrac_low"] == 0.0
    assert u["metrics"]["clipfrac_high"] == pytest.approx(np.mean(ratio > 1.28, where=mask), abs=1e-6)
    weight = np.minimum(ratio, 1.28)
    expected = agg_np(-weight * adv * u["logps"], mask, "seq-mean-token-mean")
    np.testing.assert_allclose(u["metrics"]["pg_loss"], expected, rtol=1e-4, atol=1e-6)
    assert max_abs_diff(gspo.params[0], cispo.params[0]) > 1e-2


# ----------------------------------------------------------------------------- KL to the reference


def seq_kl_k1(inputs):
    mask = inputs["loss_mask"]
    return ((inputs["old_logps"] - inputs["ref_logps"]) * mask).sum(1)


def test_kl_in_the_reward_vs_in_the_loss(runs):
    """Same rollout, same (perturbed) reference: in the reward, the advantages see
    r - beta * KL_seq and the loss has no KL term; in the loss, the rewards are untouched
    and the loss adds beta * agg(k3) and reports it."""
    in_reward, in_loss = runs("kl_reward"), runs("base")
    assert_same_rollout(in_loss, runs("dr_grpo"))
    raw = in_loss.inputs[0]["rewards"]
    np.testing.assert_array_equal(raw, runs("dr_grpo").inputs[0]["rewards"])  # untouched by the KL
    kl = seq_kl_k1(in_reward.inputs[0])
    assert np.mean(kl) > 0.05  # the reference really differs
    np.testing.assert_allclose(in_reward.inputs[0]["rewards"], raw - 0.04 * kl, rtol=1e-5, atol=1e-6)
    rewards = groups_of(in_reward.inputs[0]["rewards"])
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(groups_of(sequence_advantages(in_reward)), expected, rtol=1e-4, atol=1e-5)
    assert not np.allclose(sequence_advantages(in_reward), sequence_advantages(in_loss), atol=1e-3)
    assert in_reward.figures[0]["reward/after_kl"] == pytest.approx(float(np.mean(raw - 0.04 * kl)), rel=1e-5)
    assert "kl" not in in_reward.updates[0]["metrics"]
    # in the loss: k3 of the update's log-probs against the reference, on the response tokens
    u = in_loss.updates[0]
    mask = u["rollout"].loss_mask > 0
    log_ratio = u["logps"] - u["rollout"].ref_logps
    k3 = np.expm1(-log_ratio) + log_ratio
    assert u["metrics"]["kl"] == pytest.approx(float(np.mean(k3, where=mask)), rel=1e-4)
    assert in_loss.figures[0]["reward/after_kl"] == in_loss.figures[0]["reward/total"]
    assert u["metrics"]["loss"] == pytest.approx(
        float(u["metrics"]["pg_loss"]) + 0.04 * agg_np(k3, mask, "seq-mean-token-mean"), rel=1e-4, abs=1e-6)


def test_kl_importance_weight_changes_the_update_only_off_policy(runs):
    """``grpo.kl_importance_weight``: with ``detached_ratio`` the first (on-policy) update is
    the default's, loss and gradient; the second epoch's KL term is 0.04 x agg(w k3) with
    w = pi_theta / pi_old from the update's own log-probs, so its loss and step differ.
    With ``ratio`` the on-policy loss is the default's but the gradient is not (the
    differentiated weight adds the score-function term)."""
    plain, weighted = runs("epochs2"), runs("epochs2_kl_detached")
    assert_same_rollout(weighted, plain)
    assert len(weighted.updates) == len(plain.updates) == 2
    first, first_plain = weighted.updates[0]["metrics"], plain.updates[0]["metrics"]
    for key in ("loss", "kl", "grad_norm"):
        assert first[key] == pytest.approx(first_plain[key], rel=1e-6, abs=1e-8), key
    u, u_plain = weighted.updates[1], plain.updates[1]
    np.testing.assert_allclose(u["logps"], u_plain["logps"], rtol=1e-6, atol=1e-6)  # the same policy after epoch 1
    ro, mask = u["rollout"], u["rollout"].loss_mask > 0
    lp = u["logps"].astype(np.float64)
    log_ratio = lp - ro.ref_logps
    k3 = np.expm1(-log_ratio) + log_ratio
    w = np.exp(lp - ro.old_logps)
    assert np.max(np.abs(w - 1), where=mask, initial=0.0) > 1e-2  # off-policy
    assert u["metrics"]["kl"] == pytest.approx(float(np.mean(w * k3, where=mask)), rel=1e-4)
    assert u["metrics"]["loss"] == pytest.approx(
        float(u["metrics"]["pg_loss"]) + 0.04 * agg_np(w * k3, mask, "seq-mean-token-mean"), rel=1e-4, abs=1e-6)
    assert not math.isclose(u["metrics"]["loss"], u_plain["metrics"]["loss"], rel_tol=1e-5)
    assert not math.isclose(u["metrics"]["grad_norm"], u_plain["metrics"]["grad_norm"], rel_tol=1e-5)
    assert max_abs_diff(weighted.params[0], plain.params[0]) > 0

    ratio, base = runs("kl_ratio"), runs("base")
    assert_same_rollout(ratio, base)
    assert ratio.updates[0]["metrics"]["loss"] == pytest.approx(base.updates[0]["metrics"]["loss"], rel=1e-6)
    assert not math.isclose(ratio.figures[0]["grad_norm"], base.figures[0]["grad_norm"], rel_tol=1e-4)


def test_off_policy_sequence_mask_in_the_trainer(runs):
    """``grpo.off_policy_mask_threshold: 1e-5``: the on-policy first update is the default's (no
    drift, nothing dropped); in the second epoch the PPO-clip term of each negative-advantage
    token whose completion drifted (mean log pi_old - log pi_theta > 1e-5) is dropped, as
    DeepSeek-V3.2's eq. 9 says on the update's own log-probs."""
    masked, plain = runs("epochs2_opsm"), runs("epochs2")
    assert_same_rollout(masked, plain)
    assert masked.updates[0]["metrics"]["off_policy_masked"] == 0.0
    for key in ("loss", "grad_norm"):
        assert masked.updates[0]["metrics"][key] == pytest.approx(plain.updates[0]["metrics"][key], rel=1e-6), key
    u = masked.updates[1]
    ro, mask = u["rollout"], u["rollout"].loss_mask > 0
    lp, old, adv = u["logps"].astype(np.float64), ro.old_logps.astype(np.float64), ro.advantages
    drift = np.where(mask, old - lp, 0.0).sum(1) / np.maximum(mask.sum(1), 1)
    keep = np.where((adv < 0) & (drift[:, None] > 1e-5), 0.0, 1.0)
    dropped = np.mean(1 - keep, where=mask)
    assert 0.05 < dropped < 0.95
    assert u["metrics"]["off_policy_masked"] == pytest.approx(dropped, abs=1e-6)
    ratio = np.exp(lp - old)
    per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
    np.testing.assert_allclose(u["metrics"]["pg_loss"], agg_np(per_token * keep, mask, "seq-mean-token-mean"),
                               rtol=1e-4, atol=1e-6)
    assert not math.isclose(u["metrics"]["grad_norm"], plain.updates[1]["metrics"]["grad_norm"], rel_tol=1e-4)


def test_top_entropy_quantile_trains_on_the_forking_tokens(runs):
    """``grpo.top_entropy_quantile: 0.2``: the (on-policy) policy term is -A on the 20 % of
    response tokens with the highest entropy under the update's own forward pass, 0 on the
    others; so the update differs from the default's."""
    run, base = runs("top_entropy"), runs("base")
    assert_same_rollout(run, base)
    u = run.updates[0]
    mask = u["rollout"].loss_mask > 0
    tau = np.quantile(u["entropy"][mask].astype(np.float64), 0.8)
    keep = (u["entropy"] >= tau).astype(np.float64)
    assert u["metrics"]["entropy_masked"] == pytest.approx(1 - np.mean(keep, where=mask), abs=1e-6)
    assert 0.15 < np.mean(keep, where=mask) < 0.3
    expected = agg_np(-u["rollout"].advantages * keep, mask, "seq-mean-token-mean")
    np.testing.assert_allclose(u["metrics"]["pg_loss"], expected, rtol=1e-4, atol=1e-6)
    assert_update_differs(run, base)


def test_sapo_soft_gate_in_the_trainer(runs):
    """``grpo.policy_loss: sapo``: on-policy its gradient is PPO-clip's (the first update's
    grad norm is the default's) and its value 2 / tau times PPO's; in the second epoch its
    policy term is -(4 / tau) sigmoid(tau (r - 1)) A with TRL's temperatures 1.0 / 1.05."""
    sapo, plain = runs("sapo_2epochs"), runs("epochs2")
    assert_same_rollout(sapo, plain)
    assert sapo.updates[0]["metrics"]["grad_norm"] == pytest.approx(plain.updates[0]["metrics"]["grad_norm"], rel=1e-5)
    u = sapo.updates[1]
    ro, mask = u["rollout"], u["rollout"].loss_mask > 0
    ratio = np.exp(np.where(mask, u["logps"] - ro.old_logps, 0.0).astype(np.float64))
    tau = np.where(ro.advantages > 0, 1.0, 1.05)
    per_token = -(4 / tau) / (1 + np.exp(-tau * (ratio - 1))) * ro.advantages
    np.testing.assert_allclose(u["metrics"]["pg_loss"], agg_np(per_token, mask, "seq-mean-token-mean"),
                               rtol=1e-4, atol=1e-6)
    assert not math.isclose(u["metrics"]["grad_norm"], plain.updates[1]["metrics"]["grad_norm"], rel_tol=1e-4)


def test_kl_importance_weight_needs_the_kl_in_the_loss():
    from alignax.config import ConfigError

    with pytest.raises(ConfigError, match="kl_importance_weight"):
        load_config(data={"algorithm": "grpo", "data": {"format": "prompt"},
                          "grpo": {"kl_placement": "reward", "kl_importance_weight": "ratio"}})
    with pytest.raises(ConfigError, match="kl_importance_weight"):
        load_config(data={"algorithm": "ppo", "data": {"format": "prompt"}, "ppo": {"kl_importance_weight": "ratio"}})
    algo = grpo_algorithm(kl_importance_weight="detached_ratio")
    assert algo.kl.loss_keywords(None, 0.04)["kl_importance_weight"] == "detached_ratio"


def adaptive_coef(coef, kl, target, rows, horizon):
    """Ziegler et al. 2019, §2.2: e = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + e n / H."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * rows / horizon)


def test_grpo_adaptive_kl_follows_the_controller(runs):
    run, fixed = runs("base"), runs("kl_reward")
    kl = float(np.mean(seq_kl_k1(run.inputs[0])))
    assert run.figures[0]["kl/ref_seq"] == pytest.approx(kl, rel=1e-4)
    # the per-token figures: k1 and k3 (exp(-d) - 1 + d, d = old - ref) over the response tokens
    inputs = run.inputs[0]
    mask = inputs["loss_mask"] > 0
    log_ratio = inputs["old_logps"].astype(np.float64) - inputs["ref_logps"]
    assert run.figures[0]["kl/ref_k1"] == pytest.approx(float(np.mean(log_ratio, where=mask)), rel=1e-3)
    assert run.figures[0]["kl/ref_k3"] == pytest.approx(float(np.mean(np.expm1(-log_ratio) + log_ratio, where=mask)),
                                                        rel=1e-3)
    assert run.trainer.alarms.state()["kl"] == [pytest.approx(f["kl/ref_seq"]) for f in run.figures]  # the alarm's KL
    assert kl > 1e-3  # above target: the coefficient must rise
    expected = adaptive_coef(0.04, kl, 1e-3, 16, 16.0)
    assert run.figures[0]["kl_coef"] == pytest.approx(expected, rel=1e-5)
    assert run.figures[0]["kl_coef"] > 0.04 * 1.1
    # the next rollout's loss uses the new coefficient, and it keeps moving
    np.testing.assert_allclose(run.inputs[1]["kl_coef"], expected, rtol=1e-5)
    kl2 = float(np.mean(seq_kl_k1(run.inputs[1])))
    assert run.figures[1]["kl_coef"] == pytest.approx(adaptive_coef(expected, kl2, 1e-3, 16, 16.0), rel=1e-5)
    # without adaptive_kl the coefficient stays put
    assert fixed.figures[0]["kl_coef"] == pytest.approx(0.04)


# ----------------------------------------------------------------------------- PPO


def ppo_algorithm(**ppo):
    return ppo_family.build_algorithm(load_config(data={"algorithm": "ppo", "data": {"format": "prompt"},
                                                        "ppo": ppo}))


def test_ppo_dual_clip_and_clip_higher_reach_the_loss():
    algo = ppo_algorithm(dual_clip_c=3.0, clip_eps_high=0.28)
    assert algo.objective.loss_fn is ppo_policy_loss
    assert dict(algo.objective.keywords) == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 3.0}
    default = ppo_algorithm()
    assert dict(default.objective.keywords) == {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
    # r = 1.25 with A > 0: inside 1 + 0.28, outside 1 + 0.2. r = 4 with A < 0: the dual clip
    # caps the loss at c |A| = 3 (instead of r |A| = 4) and cuts its gradient.
    ratios, adv = np.array([[1.25, 4.0]]), np.array([[1.0, -1.0]])
    value, metrics, grad = objective_metrics(algo, np.log(ratios), adv)
    assert metrics["clipfrac_high"] == 0.0 and metrics["dual_clipfrac"] == pytest.approx(0.5)
    assert value == pytest.approx((-1.25 + 3.0) / 2, rel=1e-5)
    assert grad[0, 1] == 0.0 and grad[0, 0] == pytest.approx(-1.25 / 2, rel=1e-5)
    value, metrics, grad = objective_metrics(default, np.log(ratios), adv)
    assert metrics["clipfrac_high"] == pytest.approx(0.5) and "dual_clipfrac" not in metrics
    assert value == pytest.approx((-1.2 + 4.0) / 2, rel=1e-5)
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(4.0 / 2, rel=1e-5)


def test_ppo_target_kl_stops_the_epochs_early(runs):
    stopped, full = runs("loss_down"), runs("reward_up")
    assert full.figures[0]["epochs_run"] == 4 and len(full.updates) == 2 * 8
    assert stopped.figures[0]["epochs_run"] == 1 and len(stopped.updates) == 2
    # the rule: the first epoch's mean approx KL exceeded 1.5 x target
    first_epoch = [u["metrics"]["approx_kl"] for u in stopped.updates]
    assert first_epoch[0] < 1e-8 and np.mean(first_epoch) > 1.5e-6  # the first minibatch is on-policy
    # dual clip is reported when on, and only then
    assert "dual_clipfrac" in full.figures[0] and "dual_clipfrac" not in stopped.figures[0]
    assert dict(full.trainer.algorithm.objective.keywords) == {"clip_eps_low": 0.2, "clip_eps_high": 0.28,
                                                               "dual_clip_c": 3.0}


def gae_np(token_rewards, values, mask, gamma=1.0, lam=0.95):
    adv = np.zeros_like(token_rewards, dtype=np.float64)
    for r in range(mask.shape[0]):
        idx = np.flatnonzero(mask[r] > 0)
        next_value = next_adv = 0.0
        for t in idx[::-1]:
            delta = token_rewards[r, t] + gamma * next_value - values[r, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[r, t]
            adv[r, t] = next_adv
    return adv


def ppo_advantages_np(inputs, kl_in_reward: bool, beta: float):
    mask = inputs["loss_mask"].astype(np.float64)
    token_rewards = np.zeros_like(mask)
    for r in range(mask.shape[0]):
        idx = np.flatnonzero(mask[r] > 0)
        if idx.size:
            token_rewards[r, idx[-1]] = inputs["rewards"][r]
    if kl_in_reward:
        token_rewards -= beta * (inputs["old_logps"] - inputs["ref_logps"]) * mask  # k1 penalty per token
    adv = gae_np(token_rewards, inputs["old_values"].astype(np.float64), mask)
    m = mask > 0
    mean = adv[m].mean()
    var = adv[m].var(ddof=1)
    return np.where(m, (adv - mean) / np.sqrt(var + 1e-8), 0.0)


def test_ppo_kl_in_the_reward_vs_in_the_loss_and_the_adaptive_coefficient(runs):
    up, down = runs("reward_up"), runs("loss_down")
    np.testing.assert_array_equal(up.inputs[0]["rewards"], down.inputs[0]["rewards"])  # same rollout
    kl = float(np.mean(seq_kl_k1(up.inputs[0])))
    assert kl > 0.05
    # in the reward: GAE over r_T - beta KL_t; in the loss: GAE over the plain rewards
    np.testing.assert_allclose(up.advantages[0], ppo_advantages_np(up.inputs[0], True, 0.05), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(down.advantages[0], ppo_advantages_np(down.inputs[0], False, 0.05),
                               rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(up.advantages[0] - down.advantages[0])) > 1e-2
    assert "kl" not in up.updates[0]["metrics"]
    u = down.updates[0]
    mask = u["rollout"].loss_mask > 0
    assert u["metrics"]["kl"] == pytest.approx(float(np.mean(u["logps"] - u["rollout"].ref_logps, where=mask)),
                                               rel=1e-4)  # k1, PPO's default estimator
    # the adaptive controller: KL above a tiny target raises beta, below a huge one lowers it
    rows = up.trainer.layout.rows
    for run, target in ((up, 1e-4), (down, 1e4)):
        measured = float(np.mean(seq_kl_k1(run.inputs[0])))
        assert run.figures[0]["kl/ref_seq"] == pytest.approx(measured, rel=1e-4)
        assert run.figures[0]["kl_coef"] == pytest.approx(adaptive_coef(0.05, measured, target, rows, 8.0), rel=1e-5)
    assert up.figures[0]["kl_coef"] == pytest.approx(0.05 * 1.2, rel=1e-5)
    assert down.figures[0]["kl_coef"] == pytest.approx(0.05 * 0.8, rel=1e-5)
    # the next rollout's KL penalty uses the raised coefficient
    np.testing.assert_allclose(up.inputs[1]["kl_coef"], 0.06, rtol=1e-5)
    np.testing.assert_allclose(up.advantages[1], ppo_advantages_np(up.inputs[1], True, 0.06), rtol=1e-4, atol=1e-4)


def test_ppo_critic_learning_rate_changes_the_critic_update_only(runs):
    """One SGD update (the step is -lr * g, no clipping): the critic's own learning rate
    scales the critic's step by lr_critic / lr = 2.5 and leaves the policy's step as it was
    (the second run also accumulates 2 micro-batches, which changes neither gradient)."""
    base, own = runs("ptx"), runs("ptx_accum2_critic_lr")
    np.testing.assert_array_equal(own.inputs[0]["rewards"], base.inputs[0]["rewards"])
    d_base, d_own = params_delta(base), params_delta(own)
    for a, b in zip(jax.tree.leaves(d_base["policy"]), jax.tree.leaves(d_own["policy"])):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-8)
    moved = 0.0
    for a, b in zip(jax.tree.leaves(d_base["critic"]), jax.tree.leaves(d_own["critic"])):
        np.testing.assert_allclose(b, 2.5 * a, rtol=1e-4, atol=1e-8)
        moved = max(moved, float(np.max(np.abs(a))))
    assert moved > 1e-5  # the critic did move
    assert max(float(np.max(np.abs(x))) for x in jax.tree.leaves(d_base["policy"])) > 1e-5


def test_ppo_critic_learning_rate_reaches_a_shared_value_head(tmp_path, toy_model):
    """With ``ppo.critic: shared`` the critic's learning rate goes to the policy-value model's
    value head only (the trainer's optimiser, on its real parameter tree)."""
    config = toy_config(tmp_path, toy_model, "ppo", steps=1, optim=SGD,
                        ppo={"critic": "shared", "critic_learning_rate": 5e-2})
    trainer = build_trainer(config, records=RECORDS)
    params = trainer.actors.initial_params
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = trainer.learner.optimizer.update(grads, trainer.learner.optimizer.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    head = [v for path, v in flat if any(getattr(k, "key", None) == "value_head" for k in path)]
    trunk = [v for path, v in flat if not any(getattr(k, "key", None) == "value_head" for k in path)]
    assert len(head) == 1 and len(trunk) > 10
    np.testing.assert_allclose(head[0], -5e-2, rtol=1e-6)
    for v in trunk:
        np.testing.assert_allclose(v, -2e-2, rtol=1e-6)


def test_ppo_ptx_loss_does_not_grow_with_grad_accumulation(runs):
    """The SFT term is normalised over the whole minibatch's tokens: the first update's
    loss, gradient and logged figures are the same with 1 or 2 micro-batches."""
    one, two = runs("ptx").figures[0], runs("ptx_accum2_critic_lr").figures[0]
    assert runs("ptx").updates[0]["ptx"] is not None
    assert one["ptx/loss"] > 0.5
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    mismatched = {key: (one[key], two[key]) for key in ("ptx/loss", "pg_loss", "policy_loss", "value/loss")
                  if not math.isclose(one[key], two[key], rel_tol=1e-5, abs_tol=1e-6)}
    assert not mismatched, f"logged loss terms change with grad_accum_steps (accum 1, accum 2): {mismatched}"


def test_ppo_resume_with_ptx_is_bit_identical(tmp_path, toy_model):
    sections = dict(rewards=HASHED, optim=SGD, data={"eval_fraction": 0.0}, train={"save_every": 2},
                    ppo={"epochs": 1, "minibatches": 1, **ptx_data(tmp_path)})
    full = train(toy_config(tmp_path / "full", toy_model, "ppo", steps=4, checkpoint={"enabled": False}, **sections),
                 records=RECORDS)  # saves nothing: saving does not touch the steps
    first = train(toy_config(tmp_path / "split", toy_model, "ppo", steps=2, **sections), records=RECORDS)
    resumed = train(toy_config(tmp_path / "split", toy_model, "ppo", steps=4, **sections), records=RECORDS)
    assert first.loop.last_step == 2 and [h["step"] for h in resumed.history] == [3, 4]
    for key in ("reward/total", "loss", "grad_norm", "ptx/loss", "value/loss", "kl/ref_seq"):
        assert [h[key] for h in full.history[2:]] == [h[key] for h in resumed.history], key
    assert len({h["ptx/loss"] for h in full.history}) == 4  # each step read a new ptx batch
    for a, b in zip(jax.tree.leaves(jax.device_get(full.loop.state.params)),
                    jax.tree.leaves(jax.device_get(resumed.loop.state.params))):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- reward-model ensemble


def test_reward_model_ensemble_of_two_different_models(tmp_path, toy_model, runs):
    """Two reward models that disagree (the second's score head perturbed), scoring the
    completions of a real rollout: the ensemble's mean, min, mean - k std and mean - k var
    each match NumPy on the two models' own scores, and differ from one another."""
    from alignax import models
    from alignax.rewards.composite import RewardConfig, RewardModels, RewardScorer

    model = models.from_pretrained(toy_model, kind="reward", new_head=True)
    paths = [str(tmp_path / "rm0"), str(tmp_path / "rm1")]
    models.save_pretrained(model, paths[0])
    head = model.score.get_value()
    model.score.set_value(head + 0.5 * jax.random.normal(jax.random.key(7), head.shape, head.dtype))
    models.save_pretrained(model, paths[1])

    ro = runs("base").updates[0]["rollout"]
    sequences = tuple(jnp.asarray(x) for x in (ro.tokens, ro.positions, ro.attention_mask))
    # each model alone, loaded back from its folder
    scores = np.stack([np.asarray(models.from_pretrained(p, kind="reward")(*sequences).rewards, np.float64)
                       for p in paths])  # [2, R]
    assert np.min(np.abs(scores[0] - scores[1])) > 1e-3  # they disagree on every completion
    mean, low, std = scores.mean(0), scores.min(0), scores.std(0)  # population std over the 2 models
    assert np.min(mean - low) > 1e-4 and np.min(std) > 1e-4  # so the rules really differ

    loaded = RewardModels.load(paths, vocab_size=32)
    rows = len(mean)
    response = np.asarray(ro.tokens)[:, -NEW_TOKENS:]
    for method, expected in (("mean", mean), ("min", low), ("mean_minus_std", mean - 0.5 * std),
                             ("mean_minus_var", mean - 0.5 * std**2)):
        section = RewardConfig(verifier_weight=0.0, reward_models=tuple(paths), ensemble=method, ensemble_k=0.5,
                               reward_model_weight=2.0)
        scorer = RewardScorer(section, max_new_tokens=NEW_TOKENS, stop_token_ids=(1,), reward_models=loaded)
        total, components = scorer.score(["x"] * rows, [{}] * rows, response, np.asarray(ro.loss_mask), sequences)
        np.testing.assert_allclose(total, 2.0 * expected, rtol=1e-4, atol=1e-5, err_msg=method)
        np.testing.assert_allclose(components["reward_model"], 2.0 * expected, rtol=1e-4, atol=1e-5, err_msg=method)
        np.testing.assert_allclose(components["reward_model_std"], std, rtol=1e-4, atol=1e-5)
