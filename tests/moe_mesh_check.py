"""Compile and run a mixture-of-experts train step on 8 fake CPU devices; print one JSON line.

Run by tests/test_moe.py (the device count is fixed when jax is imported). A tiny Qwen3-MoE
(8 experts, top 2, scanned layers) takes one SGD step of mean NLL + coef x load-balancing
loss (``make_train_step``, as every trainer) on two meshes:

- ``expert``: ``(data, fsdp, expert, tensor) = (1, 2, 4, 1)``, experts split over ``expert``
  (and ``fsdp``);
- ``fsdp``: the trainers' ``(1, 8, 1)``, experts split over ``fsdp``.

For each it reports the sharding the compiled program gives the stacked expert kernel
(``compiled.input_shardings``), the kernel's bytes on one device against its whole size,
the compiled program's per-device argument bytes, and the loss, beside the loss of the same
step on one device.
"""

from __future__ import annotations

import os

# LLVM's optimisation of the CPU code doubles the compile time and changes no sharding or sum here.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from alignax import models, ops  # noqa: E402
from alignax.parallel.sharding import batch_sharding, make_mesh, shard_tree  # noqa: E402
from alignax.trainers.engine.step import init_train_state, make_train_step  # noqa: E402

HF = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
          num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.05)


def sft_loss(graphdef, rest):
    def loss_fn(params, frozen, batch, normalisers, rng):
        del frozen, normalisers, rng
        logits = nnx.merge(graphdef, params, rest)(batch["tokens"], batch["positions"], batch["mask"]).logits
        mask = batch["mask"][:, 1:].astype(jnp.float32)
        loss = -jnp.sum(ops.token_logprobs(logits[:, :-1], batch["tokens"][:, 1:]) * mask) / jnp.sum(mask)
        return loss, {"nll": loss}

    return loss_fn


def main() -> None:
    config = models.ModelConfig.from_hf_config(HF, scan_layers=True)
    model = models.create_model(config, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, HF["vocab_size"], (8, 8)).astype(np.int32)
    data = {"tokens": tokens, "positions": np.tile(np.arange(8, dtype=np.int32), (8, 1)),
            "mask": np.ones((8, 8), np.int32)}
    sgd = optax.sgd(0.1)
    step = jax.jit(make_train_step(sft_loss(graphdef, rest), sgd, normalisers_fn=lambda b: {}))
    _, single = step(init_train_state(params, sgd, jax.random.key(0)), {}, jax.tree.map(jnp.asarray, data))
    out = {"single_device_loss": float(single.metrics["loss"]), "aux_loss": float(single.metrics["moe/aux_loss"])}
    meshes = {"expert": make_mesh((1, 2, 4, 1), ("data", "fsdp", "expert", "tensor")), "fsdp": make_mesh((1, 8, 1))}
    for name, mesh in meshes.items():
        sharded_params, sharded_rest = shard_tree(params, mesh), shard_tree(rest, mesh)
        step = jax.jit(make_train_step(sft_loss(graphdef, sharded_rest), sgd, normalisers_fn=lambda b: {}))
        state = init_train_state(sharded_params, sgd, jax.random.key(0))
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in data.items()}
        compiled = step.lower(state, {}, batch).compile()
        in_params = compiled.input_shardings[0][0].params
        kernel = in_params["model"]["layers"]["mlp"]["gate_kernel"]
        sharding = kernel.get_value() if isinstance(kernel, nnx.Variable) else kernel
        whole = params["model"]["layers"]["mlp"]["gate_kernel"][...]
        shard_shape = sharding.shard_shape(whole.shape)
        _, result = compiled(state, {}, batch)
        out[name] = {
            "expert_kernel_spec": str(sharding.spec),
            "expert_bytes": int(whole.size * whole.dtype.itemsize),
            "expert_bytes_per_device": int(np.prod(shard_shape) * whole.dtype.itemsize),
            "argument_bytes_per_device": int(compiled.memory_analysis().argument_size_in_bytes),
            "loss": float(result.metrics["loss"]),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
