"""Mistral, Phi-3, Gemma 2 and Gemma 3 text against transformers' PyTorch models (issue 33 item 1).

Each family's tiny random config (tests/support/model_families.py: windows of 4 positions,
Gemma's caps and query_pre_attn_scalar away from their neutral values, Gemma 3's local and
global RoPE bases apart) is built in transformers, every parameter perturbed off its init
(norm weights off 0/1, biases off 0), and loaded into alignax. Checks, per family:

- logits equal transformers' within 1e-4 on rows of 20 tokens (5 windows), left-padded and
  right-padded, in a layer loop and under ``scan_layers`` (the per-layer choice traced);
- the window is not ignored: with it switched off in both configs, the logits still agree
  with transformers, and differ from the windowed ones past the first window only;
- greedy decoding through the KV cache (the sampler's ``generate``, scanned layers) gives
  the full forward's log-probs (the sampler/learner agreement) and transformers' greedy
  tokens, 16 tokens past 6-token prompts, one of them left-padded;
- a folder written by transformers' ``save_pretrained`` loads, and our export loads back in
  transformers as the same class with the same logits;
- LoRA on every projection (Phi-3's fused ones included): each adapter gets a gradient,
  and the merged export gives transformers our logits; a tiny LoRA SFT step runs with the
  family swapped into configs/tiny-sft-lora.yaml's ``model.random_init``;
- a reward model exports as the family's ``*ForSequenceClassification``;
- Phi-3's ``longrope`` on both sides of ``original_max_position_embeddings``, and our export
  read by transformers with the same original length (its top-level field);
- fields a config.json omits or writes the old way read as transformers reads them
  (``num_key_value_heads``, ``sliding_window_pattern``, ``original_max_position_embeddings``);
- packed continuations (``segment_ids``) see the window they see alone (windows count
  positions, not slots), and config errors name the field.

The shared checks of test_models.py (logits with left padding, export, config round trip,
every parameter's gradient) run on these families too.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import transformers
from flax import nnx

import jax
import jax.numpy as jnp

from alignax.models import ModelConfig, from_hf_state_dict, from_pretrained, positions_from_mask, save_pretrained
from alignax.models.lora import PROJECTIONS, LoRAParam, LoraConfig, with_adapters
from alignax.sampling import SamplingConfig, generate
from alignax.trainers.api import train
from tests.support.hf_reference import hf_model, perturbed_families, state_dict, torch_logits
from tests.support.model_families import CONFIGS, HF_CLASS_NAMES
from tests.support.trainer_helpers import tiny_config

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

TOL = 1e-4
FAMILIES = ["mistral", "phi3", "gemma2", "gemma3_text"]
T = 20  # five windows of 4
SCALE = 0.3  # perturbation of every parameter: spreads the logits, so a wrong mask shows


def rows(seed: int = 0):
    """Row 0 full, row 1 left-padded by 3, row 2 right-padded by 4: ``(tokens, mask, positions)``."""
    tokens = np.random.RandomState(seed).randint(0, 64, (3, T))
    mask = np.ones((3, T), np.int64)
    mask[1, :3] = 0
    mask[2, -4:] = 0
    return tokens, mask, np.maximum(np.cumsum(mask, 1) - 1, 0)


@nnx.jit
def _forward(model, tokens, positions, mask):
    return model(tokens, positions, mask).logits


def our_logits(model, tokens, mask, positions) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))


def window_off(family: str) -> dict:
    """Overrides that make every layer full attention."""
    if family.startswith("gemma"):
        return {"layer_types": ["full_attention"] * CONFIGS[family]["num_hidden_layers"]}
    return {"sliding_window": None}


@pytest.fixture(scope="module")
def families():
    return perturbed_families(FAMILIES, scale=SCALE)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_past_the_window(families, family):
    cfg, hf, sd = families[family]
    tokens, mask, positions = rows()
    ref = torch_logits(hf, tokens, mask, positions)
    real = mask.astype(bool)
    for scan in (False, True):
        model = from_hf_state_dict(cfg, sd, scan_layers=scan)
        assert any(model.config.sliding_layers) and T > 4 * model.config.sliding_window
        assert np.abs(our_logits(model, tokens, mask, positions) - ref)[real].max() <= TOL, f"scan_layers={scan}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_window_is_not_ignored(families, family):
    cfg, hf, sd = families[family]
    tokens, mask, positions = rows(seed=1)
    windowed = our_logits(from_hf_state_dict(cfg, sd), tokens, mask, positions)
    off_cfg, off_hf = hf_model(family, seed=FAMILIES.index(family), scale=SCALE, **window_off(family))
    off = from_hf_state_dict(off_cfg, sd)
    assert not any(off.config.sliding_layers)
    unwindowed = our_logits(off, tokens, mask, positions)
    assert np.abs(unwindowed - torch_logits(off_hf, tokens, mask, positions))[mask.astype(bool)].max() <= TOL
    # row 0 (unpadded): every position past the first window differs; within it the logits are
    # the same, except Gemma 3's, whose sliding layers also rotate by their local base
    w = cfg["sliding_window"]
    if family != "gemma3_text":
        np.testing.assert_allclose(windowed[0, :w], unwindowed[0, :w], atol=1e-5)
    gaps = np.abs(windowed[0, w:] - unwindowed[0, w:]).max(axis=-1)
    assert gaps.min() > 1e-3, gaps


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_equals_full_forward_and_transformers(families, family):
    cfg, hf, sd = families[family]
    model = from_hf_state_dict(cfg, sd, scan_layers=True)
    prompts = np.random.RandomState(2).randint(3, 64, (2, 6))
    prompt_mask = np.ones_like(prompts)
    prompt_mask[1, :2] = 0  # left padding, as the sampler takes prompts
    n = 16  # the last token sees 4 of 22 positions
    graphdef, state = nnx.split(model)
    out = jax.device_get(generate(graphdef, state, jnp.asarray(prompts), jnp.asarray(prompt_mask),
                                  jax.random.key(0), config=SamplingConfig(max_new_tokens=n, greedy=True, pad_id=0)))
    assert out.response_mask.all()
    tokens, attention_mask, _ = out.sequences()
    logits = nnx.jit(lambda m, t, a: m(t, positions_from_mask(a), a).logits)(
        model, jnp.asarray(tokens), jnp.asarray(attention_mask))
    full = np.asarray(jax.nn.log_softmax(logits[:, prompts.shape[1] - 1:-1], axis=-1))
    want = np.take_along_axis(full, np.asarray(out.tokens)[..., None].astype(np.int64), axis=-1)[..., 0]
    assert np.abs(out.logps - want).max() <= 1e-5
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompts), attention_mask=torch.tensor(prompt_mask), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)[:, prompts.shape[1]:].numpy()
    np.testing.assert_array_equal(np.asarray(out.tokens), theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_folder_loads_and_export_loads_back(families, family, tmp_path):
    cfg, hf, _ = families[family]
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    tokens, mask, positions = rows(seed=3)
    ref = torch_logits(hf, tokens, mask, positions)
    real = mask.astype(bool)
    assert np.abs(our_logits(model, tokens, mask, positions) - ref)[real].max() <= TOL
    save_pretrained(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == family and written["sliding_window"] == cfg["sliding_window"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back) is type(hf)
    assert getattr(back.config, "layer_types", None) == getattr(hf.config, "layer_types", None)
    assert np.abs(torch_logits(back, tokens, mask, positions) - ref)[real].max() <= TOL
    assert ModelConfig.from_hf_config(written) == model.config


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_every_projection_trains_and_exports_merged(families, family, tmp_path):
    """Adapters on q k v o gate up down (Phi-3's fused projections included) each get a
    gradient; trained adapters merged into the export give transformers our logits."""
    cfg, _, sd = families[family]
    model = with_adapters(from_hf_state_dict(cfg, sd), LoraConfig(rank=2, targets=("all",)))
    tokens, mask, positions = rows(seed=4)
    args = (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))

    def loss(adapters, rest):
        m = nnx.merge(graphdef, adapters, rest)
        return jnp.sum(jax.nn.log_softmax(m(*args).logits)[..., 0] * args[2])

    graphdef, adapters, rest = nnx.split(model, LoRAParam, ...)
    grads = jax.jit(jax.grad(loss))(adapters, rest)
    named = {"/".join(map(str, path)): np.asarray(g) for path, g in nnx.to_flat_state(grads)}
    for layer in range(cfg["num_hidden_layers"]):
        for target in PROJECTIONS:
            assert np.abs(named[f"model/layers/{layer}/{'attn' if target in 'qkvo' else 'mlp'}/{target}_lora/b"]
                          ).max() > 0, (layer, target)
    trained = jax.tree.map(lambda a, g: a - 0.5 * g, adapters, grads)  # one step of plain gradient descent
    model = nnx.merge(graphdef, trained, rest)
    ours = our_logits(model, tokens, mask, positions)
    save_pretrained(model, tmp_path)  # merged: a plain model of the family
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    real = mask.astype(bool)
    assert np.abs(torch_logits(back, tokens, mask, positions) - ours)[real].max() <= TOL
    assert np.abs(our_logits(from_hf_state_dict(cfg, sd), tokens, mask, positions) - ours)[real].max() > 1e-3


@pytest.mark.parametrize("family", [*(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[:-1]), FAMILIES[-1]])
def test_a_tiny_lora_sft_run_steps_on_the_family(tmp_path, family):
    """configs/tiny-sft-lora.yaml with its random model's family swapped: one step, the loss
    finite, adapters alone trained. Gemma 3 in the default suite (the layer furthest from
    Llama's); the others are slow-marked: test_lora_on_every_projection_... checks their
    adapters' gradients and merged export."""
    shape = {"model_type": family, "sliding_window": 8, "query_pre_attn_scalar": 8}
    result = train(tiny_config(tmp_path, "sft-lora", steps=1, checkpoint={"enabled": False},
                               model={"random_init": shape}))
    assert result.model.config.model_type == family and any(result.model.config.sliding_layers)
    assert result.loop.last_step == 1 and np.isfinite(result.history[0]["loss"])
    adapters = [x.shape for x in jax.tree.leaves(nnx.state(result.model, LoRAParam))]
    assert len(adapters) == 2 * len(PROJECTIONS) * result.model.config.num_layers
    assert [x.shape for x in jax.tree.leaves(result.loop.state.params)] == adapters


def test_phi3_longrope_short_and_long_factors_match_transformers():
    """Phi-3's ``longrope`` (the 128k and 3.5 models): rows within ``original_max`` (16) take
    the short factors, rows past it the long ones, both scaled by the attention factor
    transformers derives (sqrt(1 + ln 4 / ln 16)); either set differs from plain RoPE."""
    rope = {"rope_type": "longrope", "rope_theta": 1000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 9.0]}
    cfg, hf = hf_model("phi3", scale=SCALE, max_position_embeddings=64, original_max_position_embeddings=16,
                       rope_parameters=rope)
    sd = state_dict(hf)
    model = from_hf_state_dict(cfg, sd)
    assert model.config.rope_attention_factor == pytest.approx((1 + np.log(4) / np.log(16)) ** 0.5)
    assert ModelConfig.from_hf_config(model.config.to_hf_config()) == model.config
    plain = from_hf_state_dict(dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), sd)
    for length in (12, 24):
        tokens = np.random.RandomState(length).randint(0, 64, (2, length))
        mask, positions = np.ones_like(tokens), np.tile(np.arange(length), (2, 1))
        ours = our_logits(model, tokens, mask, positions)
        assert np.abs(ours - torch_logits(hf, tokens, mask, positions)).max() <= TOL, length
        assert np.abs(ours - our_logits(plain, tokens, mask, positions)).max() > 1e-2, length


def test_phi3_longrope_export_keeps_its_original_length_in_transformers(tmp_path):
    """Phi3Config always has a top-level ``original_max_position_embeddings`` (4096 when the
    file omits it) that transformers puts over the one in ``rope_parameters``: our export
    writes it, so transformers switches to the long factors past 16, as we do. At 24
    positions (between 16 and 4096) an export without it gives transformers the short ones."""
    rope = {"rope_type": "longrope", "rope_theta": 1000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 9.0]}
    cfg, hf = hf_model("phi3", scale=SCALE, max_position_embeddings=64, original_max_position_embeddings=16,
                       rope_parameters=rope)
    model = from_hf_state_dict(cfg, state_dict(hf))
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["original_max_position_embeddings"] == 16
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.rope_parameters["original_max_position_embeddings"] == 16
    tokens = np.random.RandomState(24).randint(0, 64, (2, 24))
    mask, positions = np.ones_like(tokens), np.tile(np.arange(24), (2, 1))
    ours = our_logits(model, tokens, mask, positions)
    assert np.abs(torch_logits(back, tokens, mask, positions) - ours).max() <= TOL
    assert np.abs(torch_logits(hf, tokens, mask, positions) - ours).max() <= TOL


def test_original_max_position_is_read_with_transformers_priority():
    """Phi-3: the top-level field over the nested one, 4096 when the top level omits it (what
    transformers makes of a file with the nested field only); other families: the nested
    field, else ``max_position_embeddings`` (a top-level field is not read)."""
    rope = {"rope_type": "longrope", "rope_theta": 1000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    phi = dict(CONFIGS["phi3"], max_position_embeddings=64, rope_parameters=rope)
    llama3 = {k: v for k, v in CONFIGS["llama"]["rope_parameters"].items() if k != "original_max_position_embeddings"}
    cases = [("phi3", phi, 4096), ("phi3", dict(phi, original_max_position_embeddings=32), 32),
             ("llama", dict(CONFIGS["llama"], original_max_position_embeddings=32, rope_parameters=llama3), 64),
             ("llama", dict(CONFIGS["llama"], original_max_position_embeddings=32), 16)]
    for family, cfg, want in cases:
        config_cls = getattr(transformers, HF_CLASS_NAMES[family][0])
        theirs = config_cls(**{k: v for k, v in json.loads(json.dumps(cfg)).items() if k != "model_type"})
        assert theirs.rope_parameters["original_max_position_embeddings"] == want, (family, cfg)
        assert ModelConfig.from_hf_config(cfg).rope_original_max_position_embeddings == want, (family, cfg)


def test_rope_inv_freq_refuses_longrope():
    """``rope_inv_freq`` has one set of frequencies and no factor on sin/cos: for ``longrope``
    it raises (naming the function that has both) rather than hand out the short set alone."""
    from alignax.models import rope_inv_freq
    from alignax.models.config import longrope_inv_freqs

    rope = {"rope_type": "longrope", "rope_theta": 1000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 6.0, 9.0]}
    config = ModelConfig.from_hf_config(dict(CONFIGS["phi3"], rope_parameters=rope))
    with pytest.raises(ValueError, match=r"'longrope'.*use longrope_inv_freqs\(config\)"):
        rope_inv_freq(config)
    base = 1000.0 ** (np.arange(0, 8, 2) / 8)  # theta^(2i/H), H = 8
    short, long = longrope_inv_freqs(config)
    np.testing.assert_allclose(short, 1 / (np.array(rope["short_factor"]) * base), rtol=1e-6)
    np.testing.assert_allclose(long, 1 / (np.array(rope["long_factor"]) * base), rtol=1e-6)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_sliding_window_pattern_is_read_as_transformers_reads_it(family):
    """Gemma 3 takes its global layers from ``sliding_window_pattern``; Gemma2Config ignores
    the field and alternates (sliding, full, ...) whatever it says."""
    cfg = {k: v for k, v in CONFIGS[family].items() if k not in ("layer_types",)}
    cfg.update(num_hidden_layers=6, sliding_window_pattern=3)
    theirs = getattr(transformers, HF_CLASS_NAMES[family][0])(**{k: v for k, v in cfg.items() if k != "model_type"})
    want = {"gemma2": (True, False) * 3, "gemma3_text": (True, True, False) * 2}[family]
    assert tuple(t == "sliding_attention" for t in theirs.layer_types) == want
    assert ModelConfig.from_hf_config(cfg).sliding_layers == want


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text"])
def test_a_missing_num_key_value_heads_takes_the_familys_default(family):
    """A config.json without ``num_key_value_heads`` gets the family's class default in
    transformers 5 (Mistral 8, Gemma 2/3 4, Qwen2/Qwen3 32), not the query heads (Llama and
    Phi-3's default); a null reads as the query heads."""
    cfg = {k: v for k, v in CONFIGS[family].items() if k != "num_key_value_heads"}
    cfg.update(hidden_size=64, num_attention_heads=32)
    theirs = getattr(transformers, HF_CLASS_NAMES[family][0])(**{k: v for k, v in cfg.items() if k != "model_type"})
    want = {"mistral": 8, "gemma2": 4, "gemma3_text": 4, "qwen2": 32, "qwen3": 32}.get(family, 32)
    assert theirs.num_key_value_heads == want
    assert ModelConfig.from_hf_config(cfg).num_kv_heads == want
    assert ModelConfig.from_hf_config(dict(cfg, num_key_value_heads=None)).num_kv_heads == 32


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reward_model_exports_as_the_familys_sequence_classifier(families, family, tmp_path):
    """The reward head goes out as ``*ForSequenceClassification`` (``score.weight``), whose
    score at the last token transformers computes as our reward."""
    cfg, _, sd = families[family]
    model = from_hf_state_dict(cfg, sd, kind="reward", new_head=True, seed=1)
    save_pretrained(model, tmp_path)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == HF_CLASS_NAMES[family][1].replace("ForCausalLM", "ForSequenceClassification") \
        .replace("Gemma3For", "Gemma3TextFor")
    tokens = np.random.RandomState(5).randint(3, 64, (2, T))
    with torch.no_grad():
        theirs = back(input_ids=torch.tensor(tokens)).logits.numpy()[:, 0]
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens)).rewards), theirs, atol=TOL)


def test_config_errors_name_the_field():
    gemma2, gemma3, mistral = CONFIGS["gemma2"], CONFIGS["gemma3_text"], CONFIGS["mistral"]
    with pytest.raises(ValueError, match="mistral config: sliding_window must be a positive integer or null; got 0"):
        ModelConfig.from_hf_config(dict(mistral, sliding_window=0))
    with pytest.raises(ValueError, match="phi3 config: sliding_window must be a positive integer or null; got 4.0"):
        ModelConfig.from_hf_config(CONFIGS["phi3"]).replace(sliding_window=4.0)  # one check, read or built
    with pytest.raises(ValueError, match="gemma2 config: num_key_value_heads must be a positive integer; got 0"):
        ModelConfig.from_hf_config(dict(gemma2, num_key_value_heads=0))
    with pytest.raises(ValueError, match="phi3 config: original_max_position_embeddings must be a positive integer"):
        ModelConfig.from_hf_config(dict(CONFIGS["phi3"], original_max_position_embeddings=0, rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}))
    with pytest.raises(ValueError, match="layer_types has 1 entries; the model has 2 layers"):
        ModelConfig.from_hf_config(dict(gemma2, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match=r"layer_types: unknown \['chunked_attention'\]"):
        ModelConfig.from_hf_config(dict(gemma2, layer_types=["chunked_attention", "full_attention"]))
    with pytest.raises(ValueError, match="attention='cudnn' runs plain causal attention; this gemma2 model"):
        ModelConfig.from_hf_config(gemma2, attention="cudnn")
    with pytest.raises(ValueError, match="use_bidirectional_attention=true"):
        ModelConfig.from_hf_config(dict(gemma3, use_bidirectional_attention=True))
    linear = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="sliding_attention: rope_type 'linear' is not supported for the sliding"):
        ModelConfig.from_hf_config(dict(gemma3, rope_parameters={"sliding_attention": linear}))
    with pytest.raises(ValueError, match="'longrope' needs the list 'long_factor'"):
        ModelConfig.from_hf_config(dict(CONFIGS["phi3"], rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0] * 4, "original_max_position_embeddings": 16}))
    with pytest.raises(ValueError, match=r"longrope needs rope_short_factor of head_dim / 2 = 4 numbers"):
        ModelConfig.from_hf_config(dict(CONFIGS["phi3"], rope_parameters={
            "rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4,
            "original_max_position_embeddings": 16}))
    with pytest.raises(ValueError, match="model_type='gemma3' is the multimodal Gemma3ForConditionalGeneration"):
        ModelConfig.from_hf_config(dict(gemma3, model_type="gemma3"))
    # the window off: Mistral's null window, Gemma's all-global layers
    assert not any(ModelConfig.from_hf_config(dict(mistral, sliding_window=None)).sliding_layers)
    assert ModelConfig.from_hf_config(gemma2).sliding_layers == (True, False)


def test_packed_continuations_see_the_window_they_see_alone(families):
    """Windows count positions, not slots: a prefix packed with two continuations
    (``segment_ids``, positions restarting after the prefix) gives each continuation the
    logits of prefix + continuation run alone, though the second one sits 8 slots further."""
    cfg, _, sd = families["gemma2"]
    model = from_hf_state_dict(cfg, sd)
    rng = np.random.RandomState(6)
    prefix, first, second = rng.randint(0, 64, 5), rng.randint(0, 64, 8), rng.randint(0, 64, 8)
    packed = np.concatenate([prefix, first, second])[None]
    positions = np.concatenate([np.arange(13), np.arange(5, 13)])[None]
    segments = np.array([[0] * 5 + [1] * 8 + [2] * 8])
    ones = jnp.ones(packed.shape, jnp.int32)
    out = nnx.jit(lambda m, t, p, a, s: m(t, p, a, segment_ids=s).logits)(
        model, jnp.asarray(packed), jnp.asarray(positions), ones, jnp.asarray(segments))
    for part, start in ((first, 5), (second, 13)):
        alone = np.concatenate([prefix, part])[None]
        ref = our_logits(model, alone, np.ones_like(alone), np.arange(13)[None])
        np.testing.assert_allclose(np.asarray(out)[0, start:start + 8], ref[0, 5:], atol=1e-5)


def same_ids(config: ModelConfig, like: ModelConfig) -> ModelConfig:
    """``config`` with ``like``'s token ids and labels (transformers fills in defaults)."""
    return config.replace(**{k: getattr(like, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                            "num_labels")})


def test_older_gemma3_and_phi3_files_read_as_transformers_reads_them():
    """Hub files from before transformers 5 (Gemma 3: ``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling``, ``sliding_window_pattern`` and no ``layer_types``; Phi-3: ``rope_scaling``
    of type ``longrope``) give the config transformers 5 itself converts them to."""
    base = {k: v for k, v in CONFIGS["gemma3_text"].items() if k not in ("layer_types", "rope_parameters")}
    legacy = dict(base, num_hidden_layers=7, rope_theta=5000.0, rope_local_base_freq=100.0,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window_pattern=3)
    converted = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"}).to_dict()
    ours = ModelConfig.from_hf_config(legacy)
    assert ours == same_ids(ModelConfig.from_hf_config(converted), ours)
    assert ours.sliding_layers == (True, True, False, True, True, False, True)
    assert (ours.rope_theta, ours.rope_local_theta, ours.rope_type, ours.rope_factor) == (5000.0, 100.0, "linear", 2.0)
    phi = dict(CONFIGS["phi3"], rope_theta=1000.0, original_max_position_embeddings=16, max_position_embeddings=64)
    phi.pop("rope_parameters")
    phi["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    converted = transformers.Phi3Config(**{k: v for k, v in phi.items() if k != "model_type"}).to_dict()
    ours = ModelConfig.from_hf_config(phi)
    assert ours == same_ids(ModelConfig.from_hf_config(converted), ours)
    assert ours.rope_type == "longrope" and ours.rope_original_max_position_embeddings == 16
