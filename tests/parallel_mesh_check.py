"""Run by tests/test_parallel.py in a subprocess: XLA must see 8 fake CPU devices, which
can only be set before jax is imported. Prints one JSON line of measured results and
exits non-zero on the first failed check.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from alignax.models import (  # noqa: E402
    CausalLM,
    ModelConfig,
    cache_shardings,
    from_hf_state_dict,
    init_cache,
    to_hf_state_dict,
)
from alignax.parallel import batch_sharding, create_sharded, make_mesh, tree_shardings  # noqa: E402

HF = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)

# What the rules table says, written out by hand per parameter (loop layout).
EXPECTED = {
    "model.embed": P("tensor", "fsdp"),
    "model.final_norm.scale": P(None),
    "lm_head": P("fsdp", "tensor"),
    "attn.q_kernel": P("fsdp", "tensor", None),
    "attn.k_kernel": P("fsdp", "tensor", None),
    "attn.v_kernel": P("fsdp", "tensor", None),
    "attn.o_kernel": P("tensor", None, "fsdp"),
    "mlp.gate_kernel": P("fsdp", "tensor"),
    "mlp.up_kernel": P("fsdp", "tensor"),
    "mlp.down_kernel": P("tensor", "fsdp"),
    "attn_norm.scale": P(None),
    "mlp_norm.scale": P(None),
}


def name_of(keypath) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keypath)


def check_specs(model, scan: bool) -> int:
    checked = 0
    for kp, v in jax.tree_util.tree_leaves_with_path(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        name = name_of(kp)
        key = name if name in EXPECTED else ".".join(name.split(".")[-2:])
        want = EXPECTED[key]
        if scan and name.startswith("model.layers."):
            want = P(None, *want)
        got = v.get_value().sharding.spec
        assert tuple(got) == tuple(want), f"{name}: sharding {got}, rules say {want}"
        checked += 1
    return checked


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    mesh = make_mesh((2, 2, 2))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)

    config = ModelConfig.from_hf_config(HF)
    host_model = CausalLM(config, rngs=nnx.Rngs(0))
    hf_config, tensors = to_hf_state_dict(host_model)

    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 64, (4, 8))
    mask = np.ones((4, 8), np.int32)
    mask[1, :3] = 0
    mask[3, :6] = 0
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)

    forward = nnx.jit(lambda m, t, p, a: m(t, p, a).logits)
    reference = np.asarray(forward(host_model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))

    results = {"devices": jax.device_count()}
    data = batch_sharding(mesh)
    assert data.spec == P(("data", "fsdp"), None)
    t_s, p_s, m_s = (jax.device_put(jnp.asarray(x), data) for x in (tokens, positions, mask))
    for scan in (False, True):
        model = from_hf_state_dict(hf_config, tensors, mesh=mesh, scan_layers=scan)
        results[f"params_checked_scan={scan}"] = check_specs(model, scan)
        with jax.set_mesh(mesh):
            logits = forward(model, t_s, p_s, m_s)
        diff = float(np.abs(np.asarray(logits) - reference).max())
        assert diff <= 1e-5, f"sharded forward (scan={scan}) differs from single device by {diff}"
        results[f"max_abs_diff_scan={scan}"] = diff

    # a sharded cache: batch over (data, fsdp), kv heads over tensor; prefill through it
    # under the mesh gives the single-device logits
    cache = init_cache(config, batch=4, max_len=8)
    cache_sh = cache_shardings(cache, mesh)
    assert cache_sh.k.spec == P(None, ("data", "fsdp"), None, "tensor", None), cache_sh.k.spec
    assert cache_sh.mask.spec == P(("data", "fsdp"), None) and cache_sh.index.spec == P()
    cache = jax.device_put(cache, cache_sh)
    with jax.set_mesh(mesh):
        out = nnx.jit(lambda m, t, p, a, c: m(t, p, a, cache=c))(model, t_s, p_s, m_s, cache)
    diff = float(np.abs(np.asarray(out.logits) - reference).max())
    assert diff <= 1e-5, f"sharded cached prefill differs from single device by {diff}"
    results["max_abs_diff_cached_prefill"] = diff

    # created directly sharded (no full copy on one device); same specs
    created = create_sharded(lambda: CausalLM(config.replace(scan_layers=True), rngs=nnx.Rngs(1)), mesh)
    results["created_params_checked"] = check_specs(created, scan=True)
    q = nnx.state(created)["model"]["layers"]["attn"]["q_kernel"].get_value()
    assert q.addressable_shards[0].data.shape == (2, 8, 2, 4), q.addressable_shards[0].data.shape

    # optimizer state follows its parameters; step counts are replicated
    params = nnx.state(model, nnx.Param)
    opt_state = optax.adam(1e-3).init(params)
    shardings = tree_shardings(opt_state, mesh)
    mu = shardings[0].mu["model"]["layers"]["mlp"]["down_kernel"].get_value()
    assert mu.spec == P(None, "tensor", "fsdp"), mu.spec
    assert shardings[0].count.spec == P(), shardings[0].count.spec
    placed = jax.device_put(opt_state, shardings)
    assert placed[0].nu["lm_head"].get_value().sharding.spec == P("fsdp", "tensor")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
