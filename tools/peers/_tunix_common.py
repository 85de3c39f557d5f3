"""Shared plumbing for the Tunix peer benchmarks (tunix_dpo.py, tunix_grpo.py).

Runs only inside the separate venv ``.venv-bench`` (see setup_tunix_env.sh): Tunix
0.1.7 pins packages that clash with alignax's own set, so nothing here imports alignax.

What lives here:
  * ``offline()``: environment for a run that never touches the network (hub offline
    flags, CPU platform) plus a socket guard that refuses any non-loopback connect, so
    an accidental download fails loudly instead of silently measuring a download.
  * model shapes: presets, Hugging Face ``config.json`` files (what alignax reads and
    what a converted SmolLM2 directory holds), and ``--set key=value`` overrides, all
    normalised to one dict with HF key names.
  * ``build_llama``: a Tunix ``tunix.models.llama3`` model, random (seeded, std 0.02,
    RMSNorm weights 1) or loaded from a local HF safetensors directory.
  * ``CompileClock``: sums JAX's own compile-time events (trace, lower, XLA compile),
    shared with tools/bench_common.py.
  * ``IntTokenizer``: a whitespace-separated-integers tokenizer, so prompts have exact
    token lengths and no tokenizer files are needed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

# Tokens reserved by IntTokenizer; random data draws ids from [FIRST_FREE_ID, vocab).
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_FREE_ID = 3

# Shapes in Hugging Face config.json names (LlamaConfig), so a preset, an HF file and
# alignax's ModelConfig.from_hf_config all describe a network the same way.
PRESETS = {
    # Small random Llama for quick side-by-side runs (2 layers, hidden 256).
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # SmolLM2-135M(-Instruct) shape, values from its HF config.json.
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
}

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def offline() -> None:
    """Offline, CPU-only environment. Call before importing jax or tunix."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["WANDB_MODE"] = "disabled"
    _guard_sockets()


def _is_local(address) -> bool:
    if not isinstance(address, tuple):  # AF_UNIX path
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _guard_sockets() -> None:
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex

    def connect(self, address):
        if not _is_local(address):
            raise ConnectionRefusedError(
                f"tools/peers: network access to {address!r} is disabled in benchmark runs"
            )
        return original_connect(self, address)

    def connect_ex(self, address):
        if not _is_local(address):
            raise ConnectionRefusedError(
                f"tools/peers: network access to {address!r} is disabled in benchmark runs"
            )
        return original_connect_ex(self, address)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex


# ---------------------------------------------------------------------- model shapes


def _normalise(cfg: dict) -> dict:
    """HF LlamaConfig-style dict with every field the Tunix model needs."""
    out = dict(cfg)
    rope = out.get("rope_parameters") or out.get("rope_scaling") or {}
    if "rope_theta" not in out and isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out.setdefault("rope_theta", 10000.0)
    out.setdefault("rms_norm_eps", 1e-6)
    out.setdefault("tie_word_embeddings", False)
    missing = [k for k in _REQUIRED if k not in out]
    if missing:
        raise ValueError(f"model config is missing {missing}; expected HF LlamaConfig keys {list(_REQUIRED)}")
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
    model_type = out.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"model_type {model_type!r} is not a Llama; these scripts build tunix.models.llama3 only"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    out["rope_type"] = rope_type
    return out


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def load_model_spec(model_config: str | None, weights_dir: str | None, overrides: list[str]) -> dict:
    """Shape dict from a preset name, a config.json path, or ``weights_dir/config.json``."""
    if model_config is None:
        if weights_dir is None:
            raise ValueError("give --model-config (preset or config.json path) or --weights-dir with a config.json")
        model_config = str(Path(weights_dir) / "config.json")
    if model_config in PRESETS:
        cfg = dict(PRESETS[model_config])
        cfg["_source"] = f"preset:{model_config}"
    else:
        path = Path(model_config)
        if not path.is_file():
            raise ValueError(
                f"--model-config {model_config!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
            )
        cfg = json.loads(path.read_text())
        cfg["_source"] = str(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value; got {item!r}")
        cfg[key] = _parse_value(value)
    return _normalise(cfg)


def shape_summary(spec: dict) -> dict:
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "rope_theta",
        "rms_norm_eps",
    )
    return {k: spec[k] for k in keys} | {"source": spec["_source"]}


def tunix_llama_config(spec: dict, *, remat: str = "none"):
    from tunix.models.llama3 import model as llama

    return llama.ModelConfig(
        num_layers=int(spec["num_hidden_layers"]),
        vocab_size=int(spec["vocab_size"]),
        embed_dim=int(spec["hidden_size"]),
        hidden_dim=int(spec["intermediate_size"]),
        num_heads=int(spec["num_attention_heads"]),
        head_dim=int(spec["head_dim"]),
        num_kv_heads=int(spec["num_key_value_heads"]),
        rope_theta=spec["rope_theta"],
        norm_eps=float(spec["rms_norm_eps"]),
        weight_tying=bool(spec["tie_word_embeddings"]),
        remat_config=llama.RematConfig[remat.upper()],
    )


def build_llama(spec: dict, *, weights_dir: str | None, seed: int, dtype: str, remat: str = "none"):
    """(model, note): a Tunix Llama3 module on the default device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.llama3 import model as llama
    from tunix.models.llama3 import params as llama_params

    config = tunix_llama_config(spec, remat=remat)
    jdtype = jnp.dtype(dtype)
    if weights_dir is not None:
        files = sorted(Path(weights_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"--weights-dir {weights_dir!r} holds no *.safetensors files")
        loader = "tunix.models.llama3.params.create_model_from_safe_tensors"
        try:
            model = llama_params.create_model_from_safe_tensors(
                str(weights_dir), config, mesh=None, dtype=jdtype, mode="auto"
            )
            mode = "auto"
        except (ValueError, RuntimeError) as err:
            # Tunix's fast (mmap) loader reads a whole file with the dtype of its first
            # tensor, so a file mixing bf16 and f32 tensors fails to reshape; the
            # "original" loader reads tensor by tensor.
            print(f"tools/peers: {loader} mode='auto' failed ({err}); retrying mode='original'", file=sys.stderr)
            model = llama_params.create_model_from_safe_tensors(
                str(weights_dir), config, mesh=None, dtype=jdtype, mode="original"
            )
            mode = "original"
        return model, f"weights from {weights_dir} via {loader}(mode={mode!r}), cast to {dtype}"

    model = llama.Llama3(config, rngs=nnx.Rngs(params=seed))
    # Tunix initialises the MLP kernels to zero (so a random model has no MLP signal)
    # and the other matrices with N(0, 0.01); give every matrix the usual N(0, 0.02)
    # (norm scales stay 1). Timing does not depend on the values.
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        (x if x.ndim < 2 else 0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(jdtype)
        for x, k in zip(leaves, keys)
    ]
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, new))
    return model, f"random init (seed {seed}, std 0.02, norm weights 1)"


# ---------------------------------------------------------------------- LoRA (qwix)

# The seven projections of Tunix's llama3 (Attention: q/k/v/o_proj Einsums; MLP:
# gate/up/down_proj nnx.Linear), as alignax's ``lora.targets: [all]``.
LORA_MODULE_PATH = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"


def add_lora_args(parser) -> None:
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: train a qwix LoRA of this rank on the seven projections (Tunix's LoRA path)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="qwix LoraProvider alpha (default 2 x rank)")
    parser.add_argument("--lora-qtype", default=None, choices=("nf4", "int8", "int4"),
                        help="QLoRA: qwix weight_qtype of the frozen base (tile size --lora-tile-size)")
    parser.add_argument("--lora-tile-size", type=int, default=64)
    parser.add_argument("--memory", action="store_true",
                        help="also compile the train step ahead of time and report compiled.memory_analysis()")


def policy_and_reference(model, args):
    """``(policy, reference, lora summary or None)`` from a built model: with ``--lora-rank``
    the policy is a qwix LoRA of ``model`` and the reference ``model`` itself (the
    adapter-free base); otherwise the reference is a clone of the policy."""
    from flax import nnx

    if args.lora_rank > 0:
        policy, lora = apply_lora(model, args)
        return policy, model, lora
    return model, nnx.clone(model), None


def apply_lora(base, args):
    """``(lora_model, summary)``: ``qwix.apply_lora_to_model`` on ``base`` as Tunix's CLI does it
    (tunix/cli/utils/model.py: a LoraProvider, the model's own dummy input). qwix clones the
    model first, so ``base`` stays a separate, adapter-free copy."""
    import jax
    import qwix
    from flax import nnx

    alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    kwargs = {"module_path": LORA_MODULE_PATH, "rank": args.lora_rank, "alpha": alpha}
    if args.lora_qtype is not None:
        kwargs |= {"weight_qtype": args.lora_qtype, "tile_size": args.lora_tile_size}
    model = qwix.apply_lora_to_model(base, qwix.LoraProvider(**kwargs), rngs=nnx.Rngs(args.seed),
                                     **base.get_model_input())
    lora_leaves = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    summary = {"provider": "qwix.LoraProvider", **{k: v for k, v in kwargs.items()},
               "lora_parameters": int(sum(x.size for x in lora_leaves)),
               "lora_bytes": int(sum(x.nbytes for x in lora_leaves)),
               "policy_state_bytes": state_bytes(model)}
    return model, summary


def state_bytes(module) -> int:
    """Bytes of every array in ``module``'s state (weights, LoRA factors, quantised codes)."""
    import jax
    from flax import nnx

    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(module)) if hasattr(x, "nbytes")))


def compiled_memory(jitted, *args) -> dict:
    """``memory_analysis()`` of ``jitted`` (an ``nnx.jit`` function) compiled for ``args``:
    the same figures and peak as tools/bench_common.compiled_memory."""
    return bench_common.compiled_memory(jitted.lower(*args).compile())


def persistent_cache(directory: str) -> None:
    """JAX's persistent compilation cache in ``directory`` for every compile, so that
    compiling a step again ahead of time (for its memory analysis) reads the executable
    the run compiled instead of compiling it a second time."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


LOADED_WARMUP_NOTE = (
    "weights from Tunix's safetensors loader are committed to the device while "
    "nnx.Optimizer's step counter is not, so Tunix's jitted train step compiles again on "
    "the second step (committed-ness of its inputs changes); warmup raised to >= 2 so the "
    "timed steps exclude it, and compile_time_s counts both compiles."
)


def min_warmup(requested: int, weights_dir: str | None) -> tuple[int, list[str]]:
    """Warmup steps to run: at least 2 with loaded weights (see LOADED_WARMUP_NOTE)."""
    if weights_dir is not None and requested < 2:
        return 2, [LOADED_WARMUP_NOTE]
    return requested, []


def model_caveats(spec: dict) -> list[str]:
    """Where Tunix's Llama3 computes something other than the HF config says."""
    out = []
    if float(spec["rope_theta"]) != 1_000_000.0:
        out.append(
            f"Tunix 0.1.7 llama3 ignores rope_theta={spec['rope_theta']:g}: Attention.block calls "
            "apply_rope without it, so RoPE always uses base 1e6 (same cost, different numbers)."
        )
    if spec.get("rope_type", "default") != "default":
        out.append(f"Tunix llama3 applies no RoPE scaling; config asks for rope_type={spec['rope_type']!r}.")
    return out


def count_params(model) -> int:
    import jax
    from flax import nnx

    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


# ---------------------------------------------------------------------- timing


# CompileClock (sums JAX's compile events) and median are bench_common's: that module
# imports only the standard library at import time, so this venv can use it too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_common  # noqa: E402

CompileClock = bench_common.CompileClock
median = bench_common.median


def versions() -> dict:
    import importlib.metadata as md

    import jax

    return {
        "version": md.version("google-tunix"),
        "jax": jax.__version__,
        "jaxlib": md.version("jaxlib"),
        "flax": md.version("flax"),
        "optax": md.version("optax"),
    }


_REAL_STDOUT_FD: int | None = None


def reserve_stdout() -> None:
    """Send everything (Python prints, C/XLA output) to stderr; keep stdout for emit()."""
    global _REAL_STDOUT_FD
    if _REAL_STDOUT_FD is None:
        sys.stdout.flush()
        _REAL_STDOUT_FD = os.dup(1)
        os.dup2(2, 1)


def emit(result: dict) -> None:
    """The one JSON line on stdout."""
    line = (json.dumps(result) + "\n").encode()
    sys.stdout.flush()
    os.write(_REAL_STDOUT_FD if _REAL_STDOUT_FD is not None else 1, line)


def quiet_logs() -> None:
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        absl_logging.set_stderrthreshold("warning")
    except Exception:  # pragma: no cover - absl version differences
        pass


# ---------------------------------------------------------------------- tokenizer


class IntTokenizer:
    """Text is whitespace-separated token ids: exact lengths, no vocabulary files.

    Satisfies Tunix's duck-typed tokenizer protocol (encode, decode, bos_id, eos_id,
    pad_id), so Tunix's sampler and trainers run unchanged on random models.
    """

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return BOS_ID

    def eos_id(self) -> int:
        return EOS_ID

    def pad_id(self) -> int:
        return PAD_ID
