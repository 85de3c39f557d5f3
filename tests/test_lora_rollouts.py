"""LoRA in online RL: the merged sampler (``lora.merge_for_sampling``) and PPO's critic as
an adapter of its own on the policy's frozen base (``ppo.critic: adapter``).

One QLoRA PPO run (NF4 base) on the toy task (tests/support/rl_toy.py) with both keys on, built
once (the critic shares the quantised base; the merge dequantises it):

- the merged sampler generates what the unmerged one does (greedy: same tokens,
  log-probs within 1e-5), and its decode step has no adapter matmuls: the decode loop's
  body holds exactly the dot ops of the plain base model, the unmerged one two more per
  adapter;
- the value loss's gradient reaches the critic's adapter and value head and nothing of the
  policy; the critic's values equal an independent forward (the policy's graph with the
  critic's adapters, its hidden states times the value head) and differ from the policy's
  adapters' path; the NF4 base is bitwise unchanged by training; no second base exists
  (every buffer the run holds accounted for, the base once);
- the checkpoint holds the critic adapter: resuming from it repeats the next rollout
  step bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from alignax.models.lora import LoRAParam
from alignax.sampling import generate
from alignax.trainers.engine import adapters
from alignax.trainers.online.rollout import Minibatch, Rollout
from tests.support.trainer_helpers import perturbed

pytestmark = pytest.mark.xdist_group("lora-ppo")  # every test shares the module's run: one worker builds it


def _copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


@pytest.fixture(scope="module")
def ppo_lora(tmp_path_factory, toy_model):
    from alignax.checkpoint import Checkpointer
    from alignax.trainers.api import build_trainer
    from tests.support.rl_toy import toy_config, toy_prompts

    tmp = tmp_path_factory.mktemp("lora-ppo")
    config = toy_config(tmp / "run", toy_model, "ppo", steps=2, checkpoint={"enabled": False},
                        lora={"rank": 4, "alpha": 8, "quantize": "nf4", "merge_for_sampling": True},
                        ppo={"critic": "adapter", "epochs": 1, "minibatches": 1},
                        # a reward every row gets: returns the value head must learn from the first step
                        rewards={"functions": {"tests.support.rl_toy:constant_reward": 1.0}})
    trainer = build_trainer(config, records=toy_prompts(16))
    state, frozen = trainer.start()
    initial = _copy(state.params)
    base_before = _copy(trainer.actors.base)
    batches = trainer.data.iterator("train")
    state, _ = trainer.rollout_step(state, frozen, next(batches), batches)
    ckpt = Checkpointer(str(tmp / "checkpoints"), async_save=False)
    ckpt.save(1, state, {})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    batch = next(batches)
    state, _ = trainer.rollout_step(state, frozen, batch, batches)  # donates the step-1 state
    return dict(trainer=trainer, frozen=frozen, state=state, initial=initial, base_before=base_before, ckpt=ckpt,
                abstract=abstract, batch=batch, batches=batches)


# ---------------------------------------------------------------------------- the merged sampler
def _dots_in_decode_loop(fn, *args) -> int:
    """``dot_general`` ops in the body of the (one) ``while`` of ``fn``'s jaxpr: the decode step."""

    def subjaxprs(eqn):
        for value in eqn.params.values():
            for v in (value if isinstance(value, (tuple, list)) else (value,)):
                if hasattr(v, "eqns"):
                    yield v
                elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                    yield v.jaxpr

    def count(jaxpr):
        return sum((eqn.primitive.name == "dot_general") + sum(count(j) for j in subjaxprs(eqn))
                   for eqn in jaxpr.eqns)

    def whiles(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                yield eqn.params["body_jaxpr"].jaxpr
            for j in subjaxprs(eqn):
                yield from whiles(j)

    bodies = list(whiles(jax.make_jaxpr(fn)(*args).jaxpr))
    assert len(bodies) == 1, len(bodies)
    return count(bodies[0])


def test_merged_sampler_generates_as_unmerged_without_adapter_matmuls(ppo_lora, toy_model):
    from alignax.models import from_pretrained

    trainer, state = ppo_lora["trainer"], ppo_lora["state"]
    actors = trainer.actors
    assert actors.sampler.graphdef is actors.sampling_graphdef is not actors.graphdef  # the key is read
    params = dict(state.params, policy=perturbed(state.params["policy"], scale=0.2, seed=1))  # adapters that matter
    unmerged = nnx.merge_state(trainer.actors.whole_policy(params), trainer.actors.rest)
    merged = trainer.actors.sampling_state(params)
    assert not jax.tree.leaves(nnx.state(nnx.merge(trainer.actors.sampling_graphdef, merged), LoRAParam))
    batch = ppo_lora["batch"]
    prompts, mask = (jnp.asarray(batch[k]) for k in ("prompt_tokens", "prompt_attention_mask"))
    run = functools.partial(generate, config=trainer.actors.greedy)
    key = jax.random.key(0)
    out_unmerged = run(trainer.actors.graphdef, unmerged, prompts, mask, key)
    out_merged = run(trainer.actors.sampling_graphdef, merged, prompts, mask, key)
    np.testing.assert_array_equal(np.asarray(out_merged.tokens), np.asarray(out_unmerged.tokens))
    np.testing.assert_allclose(np.asarray(out_merged.logps), np.asarray(out_unmerged.logps), atol=1e-5)
    off = nnx.merge_state(trainer.actors.whole_policy(dict(params, policy=adapters.adapters_off(params["policy"]))),
                          trainer.actors.rest)
    assert np.any(np.asarray(run(trainer.actors.graphdef, off, prompts, mask, key).tokens)
                  != np.asarray(out_unmerged.tokens))  # the adapters are in the samples

    # the decode step: the merged model's dots are the plain base model's; unmerged adds x A and (x A) B
    assert not trainer.actors.model_config.scan_layers
    n_adapters = len(jax.tree.leaves(nnx.state(nnx.merge(trainer.actors.graphdef, unmerged), LoRAParam))) // 2
    assert n_adapters == 7 * trainer.actors.model_config.num_layers

    def dots(graphdef, state):
        return _dots_in_decode_loop(lambda s: run(graphdef, s, prompts, mask, key), state)

    plain = dots(*nnx.split(from_pretrained(toy_model)))
    assert plain > 0 and dots(trainer.actors.sampling_graphdef, merged) == plain
    assert dots(trainer.actors.graphdef, unmerged) == plain + 2 * n_adapters


# ---------------------------------------------------------------------------- PPO's critic adapter
def _minibatch(trainer, batch, seed=0):
    """A minibatch of sampled rows with random returns (what the value loss reads)."""
    tokens = np.asarray(batch["prompt_tokens"])
    mask = np.asarray(batch["prompt_attention_mask"])
    R, P = tokens.shape
    N = trainer.actors.max_new
    rng = np.random.default_rng(seed)
    response = rng.integers(3, trainer.actors.model_config.vocab_size, (R, N)).astype(np.int32)
    full = np.concatenate([tokens, response], axis=1)
    attention = np.concatenate([mask, np.ones((R, N), np.int32)], axis=1)
    positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)
    zeros = jnp.zeros((R, N), jnp.float32)
    rollout = Rollout(tokens=jnp.asarray(full), positions=jnp.asarray(positions), attention_mask=jnp.asarray(attention),
                      loss_mask=jnp.ones((R, N), jnp.float32), sampler_logps=zeros, old_logps=zeros, ref_logps=zeros,
                      old_values=zeros, advantages=jnp.asarray(rng.normal(size=(R, N)), jnp.float32),
                      returns=jnp.asarray(rng.normal(size=(R, N)), jnp.float32))
    return Minibatch(rollout=rollout, kl_coef=jnp.zeros(()), schedule_position=jnp.zeros((), jnp.int32))


def test_critic_adapter_value_gradient_values_and_one_base(ppo_lora):
    trainer, state, frozen = ppo_lora["trainer"], ppo_lora["state"], ppo_lora["frozen"]
    params = dict(state.params, critic=perturbed(state.params["critic"], scale=0.3, seed=2))
    mb = _minibatch(trainer, ppo_lora["batch"])
    loss = adapters.with_base(trainer.learner.loss_fn, merge=trainer.actors.with_frozen_base)

    def value_loss(p):
        return loss(p, frozen, mb, trainer.learner.normalisers_fn(mb), jax.random.key(0))[1].sums["value/loss"]

    grads = jax.jit(jax.grad(value_loss))(params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads["policy"]))  # the policy: untouched
    critic = nnx.to_flat_state(grads["critic"])
    assert any("value_head" in map(str, path) for path, _ in critic)
    assert all(np.any(np.asarray(g[...])) for _, g in critic)  # every critic adapter leaf and the head

    # the critic's values = the policy's graph with the critic's adapters, hidden @ value head
    ro = mb.rollout
    actors = trainer.actors
    values = actors.critic_values(actors.whole_critic(params), ro.tokens, ro.positions, ro.attention_mask)

    def via_policy_graph(lora_leaves):
        policy = nnx.merge(actors.graphdef, nnx.merge_state(lora_leaves, actors.base), actors.rest)
        hidden = policy(ro.tokens, ro.positions, ro.attention_mask, return_logits=False).hidden
        head = np.asarray(params["critic"]["value_head"][...])
        return (np.asarray(hidden, np.float64) @ head.astype(np.float64))[:, trainer.actors.prompt_len - 1:-1, 0]

    critic_lora = nnx.split_state(params["critic"], LoRAParam, ...)[0]
    policy_lora = params["policy"]
    np.testing.assert_allclose(np.asarray(values), via_policy_graph(critic_lora), atol=1e-5)
    assert np.max(np.abs(np.asarray(values) - via_policy_graph(policy_lora))) > 1e-3  # not the policy's adapters

    # one base: every buffer the run holds is the base's, an adapter's, the value head or the
    # reference's adapter-sized zeros; the critic's decoder is the base's own arrays
    base_ids = {id(x) for x in jax.tree.leaves(trainer.actors.base)}
    whole_critic = trainer.actors.whole_critic(state.params)
    decoder = nnx.split_state(whole_critic, nnx.Not(nnx.Any(LoRAParam, nnx.PathContains("value_head"))), ...)[0]
    assert jax.tree.leaves(decoder) and all(id(x) in base_ids for x in jax.tree.leaves(decoder))
    buffers = {}
    for x in jax.tree.leaves((state.params, frozen, whole_critic)):
        buffers[x.unsafe_buffer_pointer()] = x.nbytes
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.actors.base))
    trained_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    reference_zeros = sum(x.nbytes for x in jax.tree.leaves(frozen["reference"]) if id(x) not in base_ids)
    assert reference_zeros == sum(x.nbytes for x in jax.tree.leaves(state.params["policy"]))
    assert sum(buffers.values()) == base_bytes + trained_bytes + reference_zeros
    assert any(x.dtype == jnp.uint8 for x in jax.tree.leaves(trainer.actors.base))  # NF4 codes


def test_critic_adapter_trains_the_base_stays_and_resume_is_bit_identical(ppo_lora):
    trainer, state, frozen = ppo_lora["trainer"], ppo_lora["state"], ppo_lora["frozen"]
    for before, now in zip(jax.tree.leaves(ppo_lora["base_before"]), jax.tree.leaves(trainer.actors.base), strict=True):
        np.testing.assert_array_equal(np.asarray(now), before)
    initial = ppo_lora["initial"]
    # fresh: the critic's A are its own draw (lora.seed + 1), its B and value head zero
    a_policy = [x for p, x in nnx.to_flat_state(initial["policy"]) if p[-1] == "a"]
    a_critic = [x for p, x in nnx.to_flat_state(initial["critic"]) if p[-1] == "a"]
    assert len(a_policy) == len(a_critic) and all(np.any(a[...] != b[...]) for a, b in zip(a_policy, a_critic))
    head = np.asarray(state.params["critic"]["value_head"][...])
    assert not np.any(np.asarray(initial["critic"]["value_head"][...])) and np.any(head)  # the critic trained
    moved = [np.any(np.asarray(b[...]) != 0) for p, b in nnx.to_flat_state(state.params["policy"]) if p[-1] == "b"]
    assert all(moved)  # and the policy's adapters too
    # resume: the step-1 checkpoint (policy and critic adapters, value head, Adam's moments)
    restored, _ = ppo_lora["ckpt"].restore(ppo_lora["abstract"], 1)
    paths = lambda tree: {p for p, _ in nnx.to_flat_state(tree)}  # noqa: E731
    assert paths(restored.params["critic"]) == paths(state.params["critic"])
    again, _ = trainer.rollout_step(restored, frozen, ppo_lora["batch"], ppo_lora["batches"])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------- the estimator
def test_the_estimator_counts_the_critic_adapter_not_a_second_model(ppo_lora):
    """``alignax estimate`` for ``ppo.critic: adapter``: the critic's trained weights (and
    their gradients, moments) are the critic's adapter and value head as the trainer builds
    them, not a second decoder; the base is counted once."""
    from alignax import estimate as est

    trainer, state = ppo_lora["trainer"], ppo_lora["state"]
    items = est.estimate(trainer.config, model=trainer.actors.model_config, devices=1).items
    critic = sum(x.size for x in jax.tree.leaves(state.params["critic"]))
    policy = sum(x.size for x in jax.tree.leaves(state.params["policy"]))
    # the toy model's head is tied (no LM-head adapter): the critic's adapters are the
    # policy's count, plus a value head of hidden_size weights
    assert critic == policy + trainer.actors.model_config.hidden_size
    assert items["critic weights"] == critic * 4 and items["critic optimizer moments"] == critic * 8  # float32
    assert items["policy weights"] == policy * 4
