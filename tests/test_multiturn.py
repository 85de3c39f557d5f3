"""Multi-turn rollouts on the toy agent model: incremental prefill across turns against a
forward pass over the whole trajectory, how trajectories end, and the trajectory masks
(observation tokens get no gradient; model tokens get a single-turn row's gradient)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from alignax import models
from alignax.config import ConfigError
from alignax.envs.base import EnvError
from alignax.envs.calculator import CalculatorEnv
from alignax.envs.registry import env_spec
from alignax.envs import rollout
from alignax.envs.rollout import EnvSampler, trajectory_figures
from alignax.models import positions_from_mask
from alignax.models.cache import init_cache
from alignax.sampling import SamplingConfig
from alignax.sampling.multiturn import extend, generate_turn
from alignax.trainers.online.rollout import response_forward
from tests.support.toy_agent import ChattyEnv, agent_tokenizer, lookup_records, make_agent_model

P = 16  # prompt width


class BreakingEnv(ChattyEnv):
    """Raises on its second step (a broken environment)."""

    steps = 0

    def step(self, message):
        self.steps += 1
        if self.steps >= 2:
            raise RuntimeError("the environment broke")
        return super().step(message)


class SlowChattyEnv(ChattyEnv):
    """ChattyEnv taking ``PAUSE`` seconds per step: the environment's share of a rollout's time."""

    def step(self, message):
        time.sleep(PAUSE)
        return super().step(message)


PAUSE = 0.01


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    directory = make_agent_model(tmp_path_factory.mktemp("agent-model"))
    model = models.from_pretrained(directory)
    tok = agent_tokenizer()
    graphdef, state = nnx.split(model)
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    # common words stop a turn too, so the random model ends turns early and often
    stops = tuple(tok.convert_tokens_to_ids(w) for w in ("<|im_end|>", "yes", "no", "ok", "sure", "hi", "is"))
    return dict(model=model, tok=tok, graphdef=graphdef, state=state, mesh=mesh, stops=stops)


def sampler(agent, make_env, *, budget=40, turns=3, turn_tokens=6, observation=12, temperature=1.0,
            share_prompt=True):
    tok = agent["tok"]
    config = SamplingConfig(max_new_tokens=budget, temperature=temperature, stop_token_ids=agent["stops"],
                            pad_id=tok.pad_token_id, num_samples=2)
    return EnvSampler(agent["graphdef"], agent["model"].config, tok, make_env, config, mesh=agent["mesh"],
                      place=jnp.asarray, prompt_len=P, max_turns=turns, max_turn_tokens=turn_tokens,
                      max_observation_tokens=observation, share_prompt=share_prompt)


@pytest.fixture(scope="module")
def chatty(agent):
    calls = []  # the first turn's ``shared``: how many rows one prompt prefill serves

    def spy(*args, **kwargs):
        calls.append(kwargs["shared"])
        return generate_turn(*args, **kwargs)

    rollout.generate_turn = spy
    try:
        groups, seconds, drawn = sampler(agent, SlowChattyEnv).sample(
            agent["state"], {"references": lookup_records(4)}, jax.random.key(3))
    finally:
        rollout.generate_turn = generate_turn
    return groups, seconds, drawn, calls


def full_forward_logps(model, groups):
    tokens, positions, attention = groups.full_sequences()
    logps, _, _ = response_forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(attention),
                                   prompt_len=P, temperature=1.0, chunk_size=None)
    return np.asarray(logps)


def test_incremental_prefill_matches_the_whole_trajectory_from_scratch(agent, chatty):
    groups, _, drawn, _ = chatty
    actions = groups.actions()
    assert drawn == actions.sum()
    observations = (groups.response_mask > 0) & (actions == 0)
    # trajectories of several turns, observations between them, rows ending at different lengths
    assert observations.any(axis=1).sum() >= 2 and groups.trajectory["turns"].max() == 3
    assert len(set(groups.response_mask.sum(axis=1))) > 1
    # the sampler's log-probs at temperature 1 (nothing truncated) are log p of the model;
    # the trainer recomputes them from one forward pass over prompt + whole trajectory
    recomputed = full_forward_logps(agent["model"], groups)
    np.testing.assert_allclose(np.where(actions > 0, groups.sampler_logps, 0), np.where(actions > 0, recomputed, 0),
                               atol=1e-5)
    assert np.all(groups.sampler_logps[actions == 0] == 0)


def test_extend_takes_a_bool_mask(agent):
    """A bool mask counts as 0/1: the positions advance by the real tokens and stay int32."""
    model = agent["model"]
    cache = init_cache(model.config, batch=2, max_len=8)
    tokens = jnp.asarray([[1, 5, 6, 7], [4, 5, 6, 7]], jnp.int32)
    mask = jnp.asarray([[False, True, True, True], [True, True, True, True]])
    position = jnp.asarray([2, 0], jnp.int32)
    logits, _, after = extend(model, cache, position, tokens, mask)
    assert after.dtype == jnp.int32 and after.tolist() == [5, 4]
    assert logits.shape == (2, model.config.vocab_size)


def test_a_turn_cache_holds_the_prompt_the_later_chunks_and_each_turns_decode_steps():
    """16 prompt slots, 2 more chunks of 6 (the first turn's chunk is the prompt), 3 turns of
    up to 5 tokens, whose last token is never fed: 16 + 12 + 12 slots."""
    from alignax.sampling.multiturn import turn_cache_length

    assert turn_cache_length(16, 6, 5, 3) == 40
    assert turn_cache_length(16, 6, 5, 1) == 16 + 4


def test_extend_gives_the_logits_of_a_full_forward_pass(agent):
    """Chunk by chunk into one cache (left-padded chunks, holes in the cache) against the
    full forward pass over the same tokens written contiguously."""
    model, graphdef = agent["model"], agent["graphdef"]
    rng = np.random.default_rng(0)
    lengths = [(5, 3, 4), (6, 1, 2)]  # per row: real tokens of three chunks
    width = (6, 6, 6)  # one compiled extend
    chunks = [np.full((2, w), 1, np.int32) for w in width]
    masks = [np.zeros((2, w), np.int32) for w in width]
    rows = [[], []]
    for r, lens in enumerate(lengths):
        for c, n in enumerate(lens):
            ids = rng.integers(4, 28, size=n)
            chunks[c][r, width[c] - n:], masks[c][r, width[c] - n:] = ids, 1
            rows[r].extend(ids.tolist())
    step = jax.jit(lambda state, *args: extend(nnx.merge(graphdef, state), *args))
    cache = init_cache(model.config, batch=2, max_len=sum(width))
    position = jnp.zeros((2,), jnp.int32)
    incremental = []
    for c in range(3):
        logits, cache, position = step(agent["state"], cache, position, jnp.asarray(chunks[c]), jnp.asarray(masks[c]))
        incremental.append(np.asarray(logits))
    assert list(np.asarray(position)) == [12, 9]
    forward = jax.jit(lambda state, seq: nnx.merge(graphdef, state)(seq, positions_from_mask(jnp.ones_like(seq)),
                                                                     jnp.ones_like(seq)).logits)
    for r in range(2):
        full = np.asarray(forward(agent["state"], jnp.asarray([rows[r] + [1] * (12 - len(rows[r]))])))[0]
        ends = np.cumsum(lengths[r]) - 1  # (right padding after the row changes no earlier logit)
        for c in range(3):
            np.testing.assert_allclose(incremental[c][r], full[ends[c]], atol=1e-5)


def test_trajectory_layout_rewards_and_counts(agent, chatty):
    groups, seconds, _, _ = chatty
    tok = agent["tok"]
    steps = groups.trajectory["tool_calls"] / 2  # ChattyEnv reports 2 calls per step
    np.testing.assert_allclose(groups.rewards, 0.25 * steps)  # the sum of the step rewards
    np.testing.assert_array_equal(groups.trajectory["malformed_calls"], steps)
    for r in range(groups.size):
        real = groups.response_mask[r] > 0
        assert np.all(real[: real.sum()]) and not real[real.sum():].any()  # contiguous, then padding
        text = tok.decode(groups.tokens[r][real & (groups.actions()[r] == 0)], skip_special_tokens=False)
        # each observation: the template's user turn "no" and the next assistant header
        assert text.count("<|im_start|> user \n no <|im_end|> \n <|im_start|> assistant \n") in (steps[r],
                                                                                                   steps[r] - 1)
    figures = trajectory_figures(groups, seconds)
    assert figures["env/malformed_call_rate"] == 0.5 and figures["env/tool_error_rate"] == 0.5
    assert figures["env/turns_per_trajectory"] == groups.trajectory["turns"].mean()
    assert figures["env/tool_calls_per_trajectory"] == 2 * steps.mean()
    # the environment's time (PAUSE per step) against the generation's (the rest of the rollout)
    assert PAUSE * steps.sum() <= figures["env/env_s"] < seconds
    assert figures["env/generation_s"] == pytest.approx(seconds - figures["env/env_s"])
    assert sum(figures[f"env/ended_{k}"] for k in ("done", "max_turns", "max_total_tokens", "turn_budget",
                                                     "observation_too_long", "env_error")) == 1.0


@pytest.mark.parametrize("case", ["env_error", "max_total_tokens", "observation_too_long", "turn_budget"])
def test_each_end_reason_is_clean_and_counted(agent, case):
    options = {"env_error": dict(make_env=BreakingEnv),
               "max_total_tokens": dict(make_env=ChattyEnv, budget=9),
               "observation_too_long": dict(make_env=lambda: ChattyEnv("no " * 12), observation=12),
               "turn_budget": dict(make_env=ChattyEnv, turn_tokens=1)}[case]
    make_env = options.pop("make_env")
    s = sampler(agent, make_env, **options)
    if case == "turn_budget":  # no stop token but the EOS: one-token turns rarely stop
        s.config = SamplingConfig(max_new_tokens=40, stop_token_ids=(agent["tok"].eos_token_id,),
                                  pad_id=agent["tok"].pad_token_id, num_samples=2, greedy=True)
    groups, _, _ = s.sample(agent["state"], {"references": lookup_records(4)}, jax.random.key(1))
    ended = groups.trajectory[f"ended_{case}"]
    assert ended.sum() > 0
    assert np.all(groups.response_mask.sum(axis=1) <= groups.tokens.shape[1])
    if case == "max_total_tokens":
        # the model's tokens past the budget are cut, or the next observation would not fit
        assert groups.tokens.shape[1] == 9 and np.all(groups.response_mask.sum(axis=1) <= 9)
    if case in ("max_total_tokens", "turn_budget"):
        assert not groups.stopped[ended > 0].any()  # truncated: rewards.mask_truncated drops them
    else:
        assert groups.stopped[ended > 0].all()
    if case == "env_error":  # the first step's reward is kept, the trajectory ends at the raise
        assert np.all(groups.trajectory["turns"][ended > 0] == 2)


class ResetBreakingEnv(ChattyEnv):
    """Raises in reset (a user's environment that cannot start a conversation)."""

    def reset(self, record):
        raise KeyError("question")


class SilentEnv(ChattyEnv):
    def reset(self, record):
        return "what is two plus two"  # a string, not a list of messages


def test_an_environment_whose_reset_fails_is_named_with_its_record(agent):
    """reset raising (or returning no conversation) cannot be skipped like a failed step:
    the error names env.name as a user writes it and the record, with the cause chained."""
    with pytest.raises(EnvError, match=r"env.name='tests.test_multiturn:ResetBreakingEnv': reset\(record 0\) raised "
                                       r"KeyError: 'question'") as info:
        sampler(agent, ResetBreakingEnv).sample(agent["state"], {"references": lookup_records(2)}, jax.random.key(0))
    assert isinstance(info.value.__cause__, KeyError) and isinstance(info.value, ConfigError)
    with pytest.raises(EnvError, match=r"env.name='tests.test_multiturn:SilentEnv': reset\(record 0\) must return a "
                                       r"list of chat messages; got str"):
        sampler(agent, SilentEnv).sample(agent["state"], {"references": lookup_records(2)}, jax.random.key(0))
    assert env_spec(CalculatorEnv()) == "calculator"  # a built-in by its name


def test_a_records_trajectories_share_one_prompt_prefill(agent, chatty):
    """The G rows of a record prefill its prompt once (the cache repeated over them), and
    play the trajectories of rows that each prefill their own: the same tokens, log-probs
    to 1e-5, rewards."""
    shared, _, _, calls = chatty
    assert calls[0] == 2 and set(calls[1:]) == {1}  # G = 2: one prefill per record, then per-row turns
    alone, _, _ = sampler(agent, ChattyEnv, share_prompt=False).sample(
        agent["state"], {"references": lookup_records(4)}, jax.random.key(3))
    assert alone.trajectory["turns"].max() > 1
    for key in ("tokens", "response_mask", "action_mask", "rewards"):
        np.testing.assert_array_equal(getattr(shared, key), getattr(alone, key), err_msg=key)
    np.testing.assert_allclose(shared.sampler_logps, alone.sampler_logps, atol=1e-5)
