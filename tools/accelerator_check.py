"""The device check: what alignax does on the accelerator it runs on, in one JSON.

    .venv/bin/python tools/accelerator_check.py --out docs/results/accelerator_check-h100.json
    .venv/bin/python tools/accelerator_check.py --tiny            # CPU, tiny shapes, < 2 min

Fields (``docs/accelerators.md`` reads them):

- ``device``: platform, device kind, the chip's key in the peak tables, device and process
  counts, jax/jaxlib versions, peak bf16 FLOP/s and HBM bandwidth (vendors' figures).
- ``attention``: each fused implementation this platform has (``cudnn`` on a GPU, ``splash``
  on a TPU; on CPU both run as stand-ins: cuDNN's route with XLA's implementation, splash
  interpreted) against ``xla`` on the same random model and rows (left and right padding):
  max |diff| of the logits at real tokens and of a DPO loss's gradient (and that over the
  gradient's largest magnitude).
- ``throughput[shape][algorithm]``: DPO, GRPO and PPO steps at SmolLM2-135M's and a ~1B
  (Llama-3.2-1B) shape (``tiny`` with ``--tiny``): random weights, float32 master weights,
  bfloat16 compute, AdamW, ``remat: full``, the platform's attention (``auto``). Step
  times are medians of the timed steps after a warm-up; tokens/s/device count every token of
  the step's rows (prompt + response) over all devices; MFU is the step's model FLOPs (below)
  over the time and the device's peak. GRPO and PPO report the rollout (generation) and the
  update separately, plus their scoring forward passes (reference, old policy, critic).
- ``memory`` beside each step: ``peak_bytes_in_use`` of ``device.memory_stats()`` after it
  (the process's peak so far: steps run smallest shape first), the compiled update's own
  bytes (``memory_analysis()``: arguments + outputs - aliased + temporaries), and
  ``alignax.estimate``'s update-step and total figures for the config of the same shapes
  (configs/tiny-{dpo,grpo,ppo}.yaml with this check's sizes) on one device.
- ``decode[shape][batch]``: the sampler's tokens/s at batch 1, 8 and 64 (greedy, bfloat16
  weights) against the HBM ceiling ``batch * bandwidth / (weight bytes + mean KV bytes)``
  (every weight and cached key/value read once per decode step).
- ``seconds``: the check's wall time. The JSON is rewritten after each workload; a workload
  that fails is its error string, and none starts past ``--budget-s`` (it says so).

Model FLOPs (PaLM's convention): per token, ``2 N + 4 L D T`` forward and three times that
for a training pass, ``N`` the matmul parameters (LM head included, embeddings' lookup not).

The steps are built here from the functional core (``alignax.models``, ``losses``,
``sampling``, ``advantages``) the trainers are made of, not by the trainers: those read
their data through grain, which the lent GPU image lacks, and this check then needs only
jax, flax, optax, orbax, chex and transformers beside alignax. They do the trainers' work
per step (same shapes, precision, optimizer, reference and critic), not the trainers'
exact programs: the estimate compares with a step built alike, not with a trainer's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from alignax import advantages, losses, ops  # noqa: E402
from alignax import config as config_io  # noqa: E402
from alignax.estimate import PEAK_FLOPS, estimate  # noqa: E402
from alignax.models import ModelConfig, create_model, layers, token_logprobs_from_hidden  # noqa: E402
from alignax.parallel import hardware  # noqa: E402
from alignax.sampling import SamplingConfig, generate  # noqa: E402
from alignax.trainers.config import TrainConfig  # noqa: E402
from alignax.trainers.engine.setup import attention_implementation  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LLAMA = {"model_type": "llama", "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
SHAPES = {  # Hugging Face config.json fields
    "tiny": {**_LLAMA, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 1024},
    "smollm2-135m": {**_LLAMA, "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0},
    "1b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "max_position_embeddings": 8192,
           "rope_theta": 500000.0},
}
# Per step: DPO pairs x (prompt + response); GRPO prompts x group; PPO prompts; decode prompt + new tokens.
SIZES = {
    "tiny": {"pairs": 2, "prompt": 16, "response": 16, "prompts": 2, "group": 2, "ppo_prompts": 4, "new": 16,
             "decode_prompt": 8, "decode_new": 16, "attention_length": 40, "chunk": 64},
    "accelerator": {"pairs": 8, "prompt": 256, "response": 256, "prompts": 8, "group": 8, "ppo_prompts": 16,
                    "new": 256, "decode_prompt": 64, "decode_new": 128, "attention_length": 512, "chunk": 128},
}
DECODE_BATCHES = (1, 8, 64)


def model_config(shape: str, *, attention: str, param_dtype="float32") -> ModelConfig:
    return ModelConfig.from_hf_config(SHAPES[shape], param_dtype=param_dtype, dtype="bfloat16", scan_layers=True,
                                      remat="full", attention=attention)


def matmul_params(c: ModelConfig) -> int:
    """Parameters that multiply (every layer's projections and the LM head; not norms or the
    embedding lookup)."""
    D, F, L = c.hidden_size, c.intermediate_size, c.num_layers
    attention = D * c.head_dim * (c.num_heads * 2 + c.num_kv_heads * 2)
    return L * (attention + D * F * (3 if c.gated_mlp else 2)) + D * c.vocab_size


def forward_flops(c: ModelConfig, rows: int, length: int) -> float:
    return rows * length * (2 * matmul_params(c) + 4 * c.num_layers * c.hidden_size * length)


def timed(fn, steps: int):
    """``(median seconds, last result)`` of ``steps`` calls after one warm-up call (which
    compiles); each call waits for its results."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def peak_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats()  # None on CPU
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def compiled_bytes(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def rows_batch(rng: np.random.Generator, rows: int, prompt: int, response: int, vocab: int) -> dict:
    """Right-padded rows ``prompt + response`` (a few short responses), as the data pipeline's."""
    T = prompt + response
    tokens = rng.integers(1, vocab, (rows, T)).astype(np.int32)
    lengths = prompt + rng.integers(response // 2, response + 1, rows)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    response_mask = mask * (np.arange(T)[None] >= prompt)
    return {"tokens": jnp.asarray(tokens * mask), "attention_mask": jnp.asarray(mask),
            "response_mask": jnp.asarray(response_mask, jnp.int32)}


def sequence_logps(model, tokens, mask, response_mask, *, chunk: int):
    """Per-token log-probs ``[B, T-1]`` of ``tokens[:, 1:]`` and the response mask they score."""
    positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
    hidden = model(tokens, positions, mask, return_logits=False).hidden
    logps = token_logprobs_from_hidden(hidden[:, :-1], model, tokens[:, 1:], chunk_size=chunk)
    return logps, response_mask[:, 1:].astype(jnp.float32)


def adamw():
    return optax.adamw(1e-6, b1=0.9, b2=0.999, weight_decay=0.0)


def make_update(loss_fn):
    """One jitted AdamW step of ``loss_fn(params, batch, frozen) -> scalar`` on float32 master
    params (the models compute in bfloat16): ``(params, opt_state, batch, frozen) ->
    (params, opt_state, loss)``, params and optimizer state donated."""
    optimizer = adamw()

    def step(params, opt_state, batch, frozen):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, frozen)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def run_update(loss_fn, params, batch, frozen, steps: int) -> dict:
    """Compile (keeping the compiled program's bytes), then time the update step."""
    step, optimizer = make_update(loss_fn)
    carry = [params, optimizer.init(params)]
    compiled = step.lower(carry[0], carry[1], batch, frozen).compile()

    def call():
        carry[0], carry[1], loss = compiled(carry[0], carry[1], batch, frozen)
        return loss

    seconds, loss = timed(call, steps)
    return {"seconds": seconds, "loss": float(loss), "compiled_bytes": compiled_bytes(compiled)}


def bf16_copy(state):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def figures(seconds: float, tokens: int, flops: float, peak: float | None) -> dict:
    """Step time, tokens/s on the one device the check uses, and MFU against ``peak``."""
    return {"step_s": seconds, "tokens": tokens, "tokens_per_s_per_device": tokens / seconds,
            "model_flops": flops, "mfu": flops / seconds / peak if peak else None}


@functools.cache
def _created(shape: str, attention: str, param_dtype: str, kind: str, seed: int):
    return nnx.split(create_model(model_config(shape, attention=attention, param_dtype=param_dtype), kind=kind,
                                  seed=seed))


def models(shape: str, attention: str, *, critic: bool = False):
    """``(policy, reference[, critic])`` as ``(graphdef, state)``: the policy (and critic) with
    float32 master weights, the frozen reference in bfloat16; all compute in bfloat16. Each
    model is created once per check (compiles are most of a CPU run); the trained states are
    fresh copies, since an update step consumes (donates) its params."""
    def fresh(graphdef_state):
        return graphdef_state[0], jax.tree.map(lambda x: x.copy(), graphdef_state[1])

    out = [fresh(_created(shape, attention, "float32", "causal_lm", 0)),
           _created(shape, attention, "bfloat16", "causal_lm", 0)]
    if critic:
        out.append(fresh(_created(shape, attention, "float32", "value", 1)))
    return out


def dpo_workload(shape: str, sizes: dict, attention: str, steps: int, peak) -> dict:
    """A DPO step (sigmoid, beta 0.1) with the live reference's forward inside it: chosen and
    rejected rows of ``prompt + response`` tokens in one policy forward."""
    (graphdef, params), (ref_graphdef, ref_state) = models(shape, attention)
    c, B, chunk = model_config(shape, attention=attention), sizes["pairs"], sizes["chunk"]
    T = sizes["prompt"] + sizes["response"]
    batch = rows_batch(np.random.default_rng(0), 2 * B, sizes["prompt"], sizes["response"], c.vocab_size)

    def loss_fn(p, batch, frozen):
        args = (batch["tokens"], batch["attention_mask"], batch["response_mask"])
        logps, mask = sequence_logps(nnx.merge(graphdef, p), *args, chunk=chunk)
        ref_logps, _ = sequence_logps(nnx.merge(ref_graphdef, frozen), *args, chunk=chunk)
        seq, ref = jnp.sum(logps * mask, 1), jnp.sum(jax.lax.stop_gradient(ref_logps) * mask, 1)
        return losses.dpo_loss(seq[:B], seq[B:], ref[:B], ref[B:], beta=0.1)[0]

    update = run_update(loss_fn, params, batch, ref_state, steps)
    out = figures(update["seconds"], 2 * B * T, 4 * forward_flops(c, 2 * B, T), peak)
    return {**out, "rows": 2 * B, "length": T, "compiled_bytes": update["compiled_bytes"],
            "peak_bytes_in_use": peak_bytes()}


def left_padded_prompts(rng: np.random.Generator, rows: int, length: int, vocab: int):
    lengths = rng.integers(length // 2, length + 1, rows)
    mask = (np.arange(length)[None] >= (length - lengths)[:, None]).astype(np.int32)
    return jnp.asarray(rng.integers(1, vocab, (rows, length)).astype(np.int32) * mask), jnp.asarray(mask)


def rollout(graphdef, params, prompts, mask, sampling: SamplingConfig, steps: int):
    """Generation with the policy's bfloat16 copy (made each step, as the trainers do):
    ``(seconds, full rows)``, rows ``[R, P + N]`` left-padded prompt, response, right padding."""
    copy = jax.jit(bf16_copy)

    def call():
        return generate(graphdef, copy(params), prompts, mask, jax.random.key(0), config=sampling)

    seconds, out = timed(call, steps)
    tokens = jnp.concatenate([out.prompt_tokens, out.tokens], 1)
    attention_mask = jnp.concatenate([out.prompt_mask, out.response_mask], 1)
    response_mask = jnp.concatenate([jnp.zeros_like(out.prompt_mask), out.response_mask], 1)
    return seconds, {"tokens": tokens, "attention_mask": attention_mask, "response_mask": response_mask,
                     "group_ids": out.group_ids}


def even_share(rows: dict) -> jax.Array:
    """A cheap rule reward ``[R]``: the share of even token ids in each response."""
    mask = rows["response_mask"]
    return jnp.sum((rows["tokens"] % 2 == 0) * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1)


def grpo_workload(shape: str, sizes: dict, attention: str, steps: int, peak) -> dict:
    """GRPO: the rollout (``prompts x group`` samples of ``new`` tokens, no stop token), the
    scoring forwards (old policy and reference log-probs), then one clipped update with a k3
    KL to the reference (beta 0.04), group advantages, seq-mean-token-mean."""
    (graphdef, params), (ref_graphdef, ref_state) = models(shape, attention)
    c, chunk = model_config(shape, attention=attention), sizes["chunk"]
    P, G, N = sizes["prompts"], sizes["group"], sizes["new"]
    prompts, mask = left_padded_prompts(np.random.default_rng(1), P, sizes["prompt"], c.vocab_size)
    sampling = SamplingConfig(max_new_tokens=N, num_samples=G, temperature=1.0)
    generation_s, rows = rollout(graphdef, params, prompts, mask, sampling, steps)
    R, T = rows["tokens"].shape

    @jax.jit
    def score(params, frozen, rows):
        args = (rows["tokens"], rows["attention_mask"], rows["response_mask"])
        old, _ = sequence_logps(nnx.merge(graphdef, params), *args, chunk=chunk)
        ref, _ = sequence_logps(nnx.merge(ref_graphdef, frozen), *args, chunk=chunk)
        adv = advantages.group_advantages(even_share(rows), method="grpo", group_ids=rows["group_ids"], num_groups=P)
        return {**rows, "old_logps": old, "ref_logps": ref, "advantages": adv}

    scoring_s, batch = timed(lambda: score(params, ref_state, rows), steps)

    def loss_fn(p, batch, frozen):
        logps, mask = sequence_logps(nnx.merge(graphdef, p), batch["tokens"], batch["attention_mask"],
                                     batch["response_mask"], chunk=chunk)
        return losses.ppo_policy_loss(logps, batch["old_logps"], batch["advantages"][:, None] * mask, mask,
                                      aggregation="seq-mean-token-mean", ref_logps=batch["ref_logps"],
                                      kl_coef=0.04, kl_kind="k3")[0]

    update = run_update(loss_fn, params, batch, ref_state, steps)
    return {"rows": R, "length": T, "new_tokens": N,
            "rollout": figures(generation_s, R * N, forward_flops(c, R, T), peak),
            "scoring": figures(scoring_s, R * T, 2 * forward_flops(c, R, T), peak),
            "update": figures(update["seconds"], R * T, 3 * forward_flops(c, R, T), peak),
            "compiled_bytes": update["compiled_bytes"], "peak_bytes_in_use": peak_bytes()}


def ppo_workload(shape: str, sizes: dict, attention: str, steps: int, peak) -> dict:
    """PPO with a separate critic: the rollout, the scoring forwards (old policy, reference,
    critic values), GAE (gamma 1, lambda 0.95) on a last-token reward with a k1 KL penalty
    (0.05) per token, then one update of policy (clip 0.2) and critic (clipped value loss,
    weight 0.5) together."""
    (graphdef, params), (ref_graphdef, ref_state), (critic_graphdef, critic) = models(shape, attention, critic=True)
    c, chunk, N = model_config(shape, attention=attention), sizes["chunk"], sizes["new"]
    prompts, mask = left_padded_prompts(np.random.default_rng(2), sizes["ppo_prompts"], sizes["prompt"],
                                        c.vocab_size)
    generation_s, rows = rollout(graphdef, params, prompts, mask, SamplingConfig(max_new_tokens=N), steps)
    R, T = rows["tokens"].shape

    def values_of(critic_params, rows):
        positions = jnp.maximum(jnp.cumsum(rows["attention_mask"], 1) - 1, 0)
        model = nnx.merge(critic_graphdef, critic_params)
        return model(rows["tokens"], positions, rows["attention_mask"]).values[:, :-1]

    @jax.jit
    def score(params, critic_params, frozen, rows):
        args = (rows["tokens"], rows["attention_mask"], rows["response_mask"])
        old, mask = sequence_logps(nnx.merge(graphdef, params), *args, chunk=chunk)
        ref, _ = sequence_logps(nnx.merge(ref_graphdef, frozen), *args, chunk=chunk)
        values = values_of(critic_params, rows) * mask
        last = jnp.arange(T - 1)[None] == (jnp.sum(rows["attention_mask"], 1) - 2)[:, None]
        rewards = (last * even_share(rows)[:, None] - 0.05 * (old - ref)) * mask
        adv, returns = advantages.gae(rewards, values, mask, gamma=1.0, lam=0.95)
        return {**rows, "old_logps": old, "values": values, "returns": returns,
                "advantages": ops.masked_whiten(adv, mask) * mask}

    scoring_s, batch = timed(lambda: score(params, critic, ref_state, rows), steps)

    def loss_fn(both, batch, frozen):
        logps, mask = sequence_logps(nnx.merge(graphdef, both[0]), batch["tokens"], batch["attention_mask"],
                                     batch["response_mask"], chunk=chunk)
        policy = losses.ppo_policy_loss(logps, batch["old_logps"], batch["advantages"], mask, clip_eps_low=0.2)[0]
        value = losses.value_loss(values_of(both[1], batch) * mask, batch["values"], batch["returns"], mask,
                                  clip_eps=0.2)[0]
        return policy + 0.5 * value

    update = run_update(loss_fn, (params, critic), batch, None, steps)
    return {"rows": R, "length": T, "new_tokens": N,
            "rollout": figures(generation_s, R * N, forward_flops(c, R, T), peak),
            "scoring": figures(scoring_s, R * T, 3 * forward_flops(c, R, T), peak),
            "update": figures(update["seconds"], R * T, 6 * forward_flops(c, R, T), peak),
            "compiled_bytes": update["compiled_bytes"], "peak_bytes_in_use": peak_bytes()}


def decode_workload(shape: str, sizes: dict, attention: str, steps: int, bandwidth: float | None) -> dict:
    """Greedy decoding at each batch of :data:`DECODE_BATCHES`: tokens/s, and the HBM ceiling
    ``batch * bandwidth / (weight bytes + mean KV-cache bytes)`` of one decode step."""
    c = model_config(shape, attention=attention, param_dtype="bfloat16")
    graphdef, state = _created(shape, attention, "bfloat16", "causal_lm", 0)  # the reference's weights
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    P, N = sizes["decode_prompt"], sizes["decode_new"]
    sampling = SamplingConfig(max_new_tokens=N, greedy=True)
    out = {}
    for batch in DECODE_BATCHES:
        prompts = jnp.asarray(np.random.default_rng(batch).integers(1, c.vocab_size, (batch, P)), jnp.int32)
        ones = jnp.ones_like(prompts)
        seconds, _ = timed(lambda: generate(graphdef, state, prompts, ones, jax.random.key(0), config=sampling), steps)
        kv_bytes = batch * (P + N / 2) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # bfloat16 cache
        ceiling = batch * bandwidth / (weight_bytes + kv_bytes) if bandwidth else None
        rate = batch * N / seconds
        out[str(batch)] = {"seconds": seconds, "tokens_per_s": rate, "hbm_ceiling_tokens_per_s": ceiling,
                           "fraction_of_ceiling": rate / ceiling if ceiling else None}
    return {"weight_bytes": weight_bytes, "prompt": P, "new_tokens": N, "batches": out}


def attention_rows(length: int, vocab: int):
    """Four rows of ``length``: unpadded, left-padded, right-padded, both."""
    mask = np.ones((4, length), np.int32)
    mask[1, : length // 4], mask[2, -length // 3:] = 0, 0
    mask[3, : length // 8], mask[3, -length // 8:] = 0, 0
    tokens = np.random.default_rng(3).integers(1, vocab, (4, length)).astype(np.int32) * mask
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)


def attention_outputs(shape: str, attention: str, rows) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits ``[4, T, V]`` and the gradient of a DPO loss (rows 0, 1 chosen; 2, 3 rejected;
    reference log-probs 0) of the model with ``attention``, same random weights."""
    graphdef, params = nnx.split(create_model(model_config(shape, attention=attention), seed=0))
    tokens, positions, mask = rows
    response = mask.at[:, : tokens.shape[1] // 2].set(0)

    @jax.jit
    def run(params):
        def loss(p):
            model = nnx.merge(graphdef, p)
            logits = model(tokens, positions, mask).logits
            logps = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
            seq = jnp.sum(logps * response[:, 1:], 1)
            return losses.dpo_loss(seq[:2], seq[2:], jnp.zeros(2), jnp.zeros(2), beta=0.1)[0], logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    logits, grads = run(params)
    return np.asarray(logits, np.float32), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]


def attention_check(shape: str, sizes: dict, platform: str) -> dict:
    """Each fused implementation against ``xla``; on CPU the stand-ins (module docstring)."""
    c = model_config(shape, attention="xla")
    rows = attention_rows(sizes["attention_length"], c.vocab_size)
    real = np.asarray(rows[2]).astype(bool)
    want_logits, want_grads = attention_outputs(shape, "xla", rows)
    scale = max(float(np.max(np.abs(g))) for g in want_grads)
    kernels = {"gpu": {"cudnn": "cuDNN fused attention"}, "tpu": {"splash": "Pallas splash kernel"},
               "cpu": {"cudnn": "stand-in: the cuDNN route with XLA's implementation (no cuDNN on CPU)",
                       "splash": "stand-in: the splash kernel in the Pallas interpreter"}}.get(platform, {})
    out = {"shape": shape, "rows": 4, "length": sizes["attention_length"], "dtype": "bfloat16"}
    for name, kernel in kernels.items():
        with ExitStack() as stack:
            if platform == "cpu" and name == "cudnn":
                fused = layers.fused_attention
                stack.enter_context(mock.patch.object(layers, "fused_attention", lambda *a, implementation, **k: fused(
                    *a, implementation="xla", **k)))
            logits, grads = attention_outputs(shape, name, rows)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(grads, want_grads))
        out[name] = {"kernel": kernel, "logits_max_abs_diff": float(np.max(np.abs(logits - want_logits)[real])),
                     "logits_max_abs": float(np.max(np.abs(want_logits)[real])),
                     "dpo_grad_max_abs_diff": diff, "dpo_grad_max_abs": scale, "dpo_grad_rel_diff": diff / scale}
    return out


def estimate_figures(algorithm: str, c: ModelConfig, sizes: dict) -> dict:
    """``alignax.estimate`` on one device for configs/tiny-<algorithm>.yaml with this check's
    sizes, precision and remat, for ``c``'s shape."""
    response = sizes["response"] if algorithm == "dpo" else sizes["new"]
    overrides = [f"data.max_prompt_length={sizes['prompt']}", "precision.compute_dtype=bfloat16",
                 "model.remat=full", "model.scan_layers=true", f"model.logprob_chunk_size={sizes['chunk']}"]
    if algorithm == "dpo":
        overrides += [f"data.batch_size={sizes['pairs']}", f"data.max_length={sizes['prompt'] + response}",
                      f"data.max_response_length={response}", "preference.reference=live"]
    else:
        prompts, group = (sizes["prompts"], sizes["group"]) if algorithm == "grpo" else (sizes["ppo_prompts"], 1)
        overrides += [f"data.batch_size={prompts}", f"rollout.num_samples={group}",
                      f"rollout.max_new_tokens={response}",
                      "rollout.pack_groups=off", f"{algorithm}.epochs=1", f"{algorithm}.minibatches=1"]
    raw = config_io.apply_overrides(config_io.load_yaml(os.path.join(ROOT, "configs", f"tiny-{algorithm}.yaml")),
                                    overrides)
    found = estimate(config_io.from_dict(TrainConfig, raw), model=c, devices=1, mesh=(1, 1, 1), suggest=False)
    return {"estimate_update_step_bytes": float(sum(found.update_step_items().values())),
            "estimate_total_bytes": found.total}


def device_info() -> dict:
    found = hardware.detect()
    chip = hardware.chip(found.device_kind)
    return {"platform": found.platform, "device_kind": found.device_kind, "chip": chip,
            "local_devices": found.local_devices, "devices": found.devices, "processes": found.processes,
            "devices_used": 1, "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
            "peak_bf16_flops": PEAK_FLOPS.get(chip), "hbm_bandwidth_bytes_per_s": hardware.HBM_BANDWIDTH.get(chip)}


WORKLOADS = {"dpo": dpo_workload, "grpo": grpo_workload, "ppo": ppo_workload}


def run_shape(shape: str, sizes: dict, attention: str, steps: int, device: dict, result: dict, save,
              deadline: float) -> None:
    """Every workload of one shape into ``result``, saved after each (a workload that fails,
    an out-of-memory say, is recorded as its error and the rest still run; none starts after
    ``deadline``, a ``time.perf_counter()`` value)."""
    c = model_config(shape, attention=attention)
    for algorithm, workload in WORKLOADS.items():
        if time.perf_counter() > deadline:
            result["throughput"].setdefault(shape, {})[algorithm] = {"skipped": "past --budget-s"}
            continue
        try:
            found = workload(shape, sizes, attention, steps, device["peak_bf16_flops"])
            found["memory"] = {"peak_bytes_in_use": found.pop("peak_bytes_in_use"),
                               "compiled_update_bytes": found.pop("compiled_bytes"),
                               **estimate_figures(algorithm, c, sizes)}
        except Exception as err:  # noqa: BLE001 - recorded in the JSON, the check goes on
            found = {"error": f"{type(err).__name__}: {err}"[:2000]}
        result["throughput"].setdefault(shape, {})[algorithm] = found
        save()
    if time.perf_counter() > deadline:
        result["decode"][shape] = {"skipped": "past --budget-s"}
        return save()
    try:
        result["decode"][shape] = decode_workload(shape, sizes, attention, steps,
                                                  device["hbm_bandwidth_bytes_per_s"])
    except Exception as err:  # noqa: BLE001
        result["decode"][shape] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    save()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny shape only (the default on CPU)")
    parser.add_argument("--shapes", default="smollm2-135m,1b", help="shapes on an accelerator (of: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--out", help="write the JSON here (also printed)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no workload after this many seconds (the device run's limit)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device = device_info()
    tiny = args.tiny or device["platform"] == "cpu"
    sizes = SIZES["tiny" if tiny else "accelerator"]
    shapes = ["tiny"] if tiny else args.shapes.split(",")
    attention = attention_implementation("auto", "bfloat16")
    result = {"device": device, "attention_used": attention, "sizes": sizes, "shapes": shapes,
              "attention": {}, "throughput": {}, "decode": {}}

    def save():
        result["seconds"] = time.perf_counter() - start
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)

    result["attention"] = attention_check(shapes[0], sizes, device["platform"])
    save()
    for shape in shapes:
        run_shape(shape, sizes, attention, args.steps, device, result, save, start + args.budget_s)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
