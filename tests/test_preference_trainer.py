"""Issue 36's preference objectives through the trainer: each option of the ``preference``
section changes the task's loss on a batch, to the value of the papers' formulas
(tests/support/preference_references.py) evaluated on log-probs and logits this file
computes on its own from full-vocabulary forward passes of the toy model; and TR-DPO's
reference moves inside the train state, is checkpointed with it and resumes bit for bit.

Policy and reference are the initial model with two draws of fixed noise on its weights
(tests/test_offline_variants.py's setup), so the implicit rewards are of both signs.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.trainers.api import build_trainer, train
from alignax.trainers.offline import preference
from tests.support import preference_references as ref
from tests.support.compiled import jitted
from tests.support.trainer_helpers import WORDS, perturbed, separable_pairs, tiny_config

pytestmark = pytest.mark.xdist_group("preference-trainer")

BETA = 0.5
NOISE = 0.1
WINDOW = 8  # < the rows: pairs run packed (WPO's pass runs them unpacked)


def uneven_pairs(n: int, seed: int = 0) -> list[dict]:
    """Pairs whose responses differ in length (LD-DPO's tail, the length-normalised variants)."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(rng.choice(WORDS, size=k))  # noqa: E731
    return [{"prompt": f"what is {words(2)}", "chosen": "yes " + words(int(rng.integers(0, 5))),
             "rejected": "no " + words(int(rng.integers(0, 5)))} for _ in range(n)]


def forward(trainer, params, batch, prefix):
    """Token log-probs ``[B, T-1]`` float64, the response mask and the logits of a plain forward pass."""
    model = jitted(trainer.model_from(params))
    tokens = np.asarray(batch[f"{prefix}tokens"])
    logits = np.asarray(model(tokens, batch[f"{prefix}positions"], batch[f"{prefix}attention_mask"]).logits,
                        np.float64)[:, :-1]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    token_logps = np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    mask = (np.asarray(batch[f"{prefix}response_mask"])[:, 1:] > 0).astype(np.float64)
    return token_logps * mask, mask, logits, tokens[:, 1:]


@pytest.fixture(scope="module")
def setup(toy_model, tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("prefobj"), "dpo", model_dir=toy_model,
                         data={"max_response_length": WINDOW}, preference={"beta": BETA})
    trainer = build_trainer(config, records=uneven_pairs(16))
    batch = next(trainer.data.iterator("train"))
    policy = perturbed(trainer.params, scale=NOISE, seed=2)
    reference = perturbed(trainer.params, scale=NOISE, seed=3)
    sides = {(who, side): forward(trainer, params, batch, f"{side}_")
             for who, params in (("policy", policy), ("reference", reference)) for side in ("chosen", "rejected")}
    return dict(config=config, trainer=trainer, batch=trainer.placer(batch), policy=policy, reference=reference,
                sides=sides)


def task_loss(setup, section: dict) -> float:
    config = setup["config"]
    config = dataclasses.replace(config, preference=dataclasses.replace(config.preference, **section))
    task = preference.make_task(config, setup["trainer"].graphdef, setup["trainer"].rest)
    batch = setup["batch"]
    loss, _ = task.loss_fn(setup["policy"], {"reference": setup["reference"]}, batch, task.normalisers_fn(batch), None)
    return float(loss)


def formula(setup, section: dict) -> float:
    """The section's loss by the papers' formulas on this file's own log-probs."""
    s = dataclasses.replace(setup["config"].preference, **section)
    sides = setup["sides"]
    (pc_tok, mc, logits_c, tc), (pr_tok, mr, logits_r, tr) = sides["policy", "chosen"], sides["policy", "rejected"]
    qc_tok, qr_tok = sides["reference", "chosen"][0], sides["reference", "rejected"][0]
    lc, lr = mc.sum(1), mr.sum(1)
    plain_pc = pc_tok.sum(1)
    if s.ld_alpha is None:
        pc, pr, qc, qr = plain_pc, pr_tok.sum(1), qc_tok.sum(1), qr_tok.sum(1)
    else:
        a = s.ld_alpha
        pc, pr = ref.ld_logps(pc_tok, mc, mr, a), ref.ld_logps(pr_tok, mr, mc, a)
        qc, qr = ref.ld_logps(qc_tok, mc, mr, a), ref.ld_logps(qr_tok, mr, mc, a)
    scale = None
    if s.use_weighting:
        scale = np.exp(ref.wpo_aligned(logits_c, tc, mc) / lc + ref.wpo_aligned(logits_r, tr, mr) / lr)
    names = (s.variant,) if isinstance(s.variant, str) else tuple(s.variant)
    w = np.ones(len(pc))
    return ref.objective(pc, pr, qc, qr, lc, lr, w, names=names, loss_weights=s.loss_weights, rpo_alpha=s.rpo_alpha,
                         nll_pc=plain_pc, beta=s.beta, eps=s.label_smoothing, tau=s.discopop_tau, f=s.f_divergence,
                         f_alpha=s.f_alpha, scale=None if scale is None else list(scale))


CASES = {
    "bco_pair": {"variant": "bco_pair"},
    "aot": {"variant": "aot", "label_smoothing": 0.1},
    "aot_unpaired": {"variant": "aot_unpaired"},
    "discopop": {"variant": "discopop", "discopop_tau": 0.5},
    "sigmoid_norm": {"variant": "sigmoid_norm"},
    "mpo": {"variant": ("sigmoid", "bco_pair", "sft"), "loss_weights": (0.8, 0.2, 1.0)},
    "rpo": {"rpo_alpha": 0.5},
    "forward_kl": {"f_divergence": "forward_kl"},
    "js": {"f_divergence": "js"},
    "alpha": {"f_divergence": "alpha", "f_alpha": 0.3},
    "wpo": {"use_weighting": True},
    "ld_dpo": {"ld_alpha": 0.3},
    "ld_mpo_wpo": {"variant": ("sigmoid", "sft"), "ld_alpha": 0.0, "use_weighting": True},
}


@pytest.fixture(scope="module")
def losses(setup):
    out = {"sigmoid": (task_loss(setup, {}), formula(setup, {}))}
    for name, section in CASES.items():
        out[name] = (task_loss(setup, section), formula(setup, section))
    return out


def test_the_pairs_have_margins_of_both_signs_and_unequal_lengths(setup):
    sides = setup["sides"]
    h = (sides["policy", "chosen"][0].sum(1) - sides["reference", "chosen"][0].sum(1)
         - sides["policy", "rejected"][0].sum(1) + sides["reference", "rejected"][0].sum(1))
    assert (h > 0).any() and (h < 0).any()
    assert (sides["policy", "chosen"][1].sum(1) != sides["policy", "rejected"][1].sum(1)).any()  # LD-DPO has tails


@pytest.mark.parametrize("name", ["sigmoid", *CASES])
def test_task_loss_is_the_papers_formula(losses, name):
    ours, want = losses[name]
    np.testing.assert_allclose(ours, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_each_option_changes_the_loss(losses, name):
    assert abs(losses[name][0] - losses["sigmoid"][0]) > 1e-3, (name, losses[name], losses["sigmoid"])


def test_hyper_parameters_reach_the_loss(setup):
    for base, changed in (({"variant": "discopop"}, {"discopop_tau": 0.2}),
                          ({"f_divergence": "alpha"}, {"f_alpha": 0.7}),
                          ({"ld_alpha": 0.3}, {"ld_alpha": 0.8}),
                          ({"rpo_alpha": 0.5}, {"rpo_alpha": 2.0}),
                          ({"variant": ("sigmoid", "sft")}, {"loss_weights": (1.0, 3.0)})):
        a, b = task_loss(setup, base), task_loss(setup, {**base, **changed})
        np.testing.assert_allclose(b, formula(setup, {**base, **changed}), rtol=2e-5, atol=2e-6)
        assert abs(a - b) > 1e-3, changed


def test_ld_dpo_precomputed_reference_gives_the_live_loss(setup):
    """The precomputed table holds the reference's LD-weighted log-probs, as the live pass computes them."""
    config = setup["config"]
    section = dataclasses.replace(config.preference, ld_alpha=0.3, reference="precomputed")
    task = preference.make_task(dataclasses.replace(config, preference=section), setup["trainer"].graphdef,
                                setup["trainer"].rest)
    batch = setup["batch"]
    values = jax.jit(task.precompute)(setup["reference"], batch)
    frozen = {"ref_logps": values}
    batch = {**batch, "record_index": np.arange(batch["chosen_tokens"].shape[0])}
    pre, _ = task.loss_fn(setup["policy"], frozen, batch, task.normalisers_fn(batch), None)
    np.testing.assert_allclose(float(pre), task_loss(setup, {"ld_alpha": 0.3}), rtol=1e-5)


# ---------------------------------------------------------------------------- TR-DPO


SYNC = {"alpha": 0.5, "tau": 2}


def tr_config(tmp_path, toy_model, steps, sync=SYNC):
    return tiny_config(tmp_path, "dpo", steps=steps, model_dir=toy_model,
                       preference={"beta": BETA, "sync_ref": sync},
                       train={"save_every": 1}, optim={"learning_rate": 0.05})


def test_tr_dpo_reference_is_frozen_between_updates_and_mixed_every_tau(tmp_path, toy_model):
    config = tr_config(tmp_path, toy_model, steps=3)
    trainer = build_trainer(config, records=separable_pairs(32))
    state, frozen = trainer.start()
    assert "reference" not in frozen  # the state carries it
    initial = jax.tree.map(np.asarray, state.extra["reference"])
    batches = trainer.data.iterator("train")
    state, _ = trainer.step(state, frozen, trainer.place_batch(next(batches)))  # step 1: no update
    for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(state.extra["reference"])):
        np.testing.assert_array_equal(a, np.asarray(b))
    before = jax.tree.map(np.asarray, state.extra["reference"])
    state, _ = trainer.step(state, frozen, trainer.place_batch(next(batches)))  # step 2: 0.5 policy + 0.5 ref
    moved = 0.0
    for p, r0, r in zip(jax.tree.leaves(state.params), jax.tree.leaves(before),
                        jax.tree.leaves(state.extra["reference"])):
        np.testing.assert_allclose(np.asarray(r), 0.5 * np.asarray(p) + 0.5 * r0, rtol=1e-6, atol=1e-7)
        moved = max(moved, float(np.max(np.abs(np.asarray(r) - r0))))
    assert moved > 1e-4


def test_tr_dpo_changes_the_run_and_resumes_bit_for_bit(tmp_path, toy_model):
    records = separable_pairs(32)
    full = train(tr_config(tmp_path / "full", toy_model, steps=5), records=records)
    plain = train(dataclasses.replace(tr_config(tmp_path / "plain", toy_model, steps=5),
                                      preference=dataclasses.replace(full.config.preference, sync_ref=None)),
                  records=records)
    losses = [h["loss"] for h in full.history]
    plain_losses = [h["loss"] for h in plain.history]
    assert losses[:2] == plain_losses[:2]  # the reference first moves after step 2
    assert abs(losses[2] - plain_losses[2]) > 1e-5
    split = tr_config(tmp_path / "split", toy_model, steps=3)
    train(split, records=records)
    resumed = train(dataclasses.replace(split, train=dataclasses.replace(split.train, total_steps=5)),
                    records=records)
    assert [h["step"] for h in resumed.history] == [4, 5]
    assert [h["loss"] for h in resumed.history] == losses[3:]
    for a, b in zip(jax.tree.leaves((full.loop.state.params, full.loop.state.extra)),
                    jax.tree.leaves((resumed.loop.state.params, resumed.loop.state.extra))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # alignax eval of the finished run scores against the reference its checkpoint carries, as
    # the run's own last evaluation did (not the initial reference)
    from alignax.trainers.api import evaluate

    figures = evaluate(tr_config(tmp_path / "full", toy_model, steps=5), records=records)
    last = full.eval_history[-1]
    assert last["step"] == 5
    assert {f"eval/{k}": v for k, v in figures.items()} == pytest.approx(
        {k: v for k, v in last.items() if k != "step"}, rel=1e-5)


def test_tr_dpo_refuses_a_precomputed_reference_and_lora(tmp_path, toy_model):
    with pytest.raises(ConfigError, match="preference.sync_ref applies to preference.reference other than "
                                          "precomputed only"):
        tiny_config(tmp_path, "dpo", preference={"sync_ref": SYNC, "reference": "precomputed"})
    with pytest.raises(ConfigError, match="preference.sync_ref with a lora section"):
        tiny_config(tmp_path, "dpo", preference={"sync_ref": SYNC}, lora={"rank": 4})
    with pytest.raises(ConfigError, match="preference.sync_ref.tau must be >= 1"):
        tiny_config(tmp_path, "dpo", preference={"sync_ref": {"tau": 0}})


def test_estimate_sizes_the_new_options_as_the_dpo_run_they_are():
    """``alignax estimate`` reads a config with every new option: the objective adds no array
    the estimator counts, and TR-DPO's reference (in the train state) is the live reference's size."""
    from alignax.estimate import estimate, model_config_for
    from alignax.trainers.api import load_config

    base = {"algorithm": "dpo", "model": {"name": "smollm2-135m-instruct"},
            "data": {"format": "preference", "max_prompt_length": 64, "max_length": 128, "max_response_length": 64,
                     "batch_size": 4}}
    plain = load_config(data=base)
    options = load_config(data={**base, "preference": {
        "variant": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0], "rpo_alpha": 0.5,
        "f_divergence": "js", "ld_alpha": 0.5, "sync_ref": {"alpha": 0.6, "tau": 64}}})
    model = model_config_for(plain)
    ours, theirs = (estimate(c, model=model, devices=1, mesh=(1, 1, 1)) for c in (options, plain))
    assert ours.items == theirs.items and ours.items["reference"] > 0


def test_wpo_weights_come_a_chunk_of_logits_at_a_time(setup, losses, monkeypatch):
    """With ``model.logprob_chunk_size`` WPO's aligned log-probs are computed as the log-probs are,
    a few positions of logits at a time (they were not: WPO's pass called the unembedding on the
    whole window, ``[rows, T, V]`` float32): the loss is still the papers' formula, and the terms
    go through ``map_time_chunks`` with the chunk size. (The toy model's vocabulary and hidden
    size are both 32, so the traced program's shapes cannot tell logits from hidden states.)"""
    config = setup["config"]
    chunk = 3
    chunked = dict(setup, config=dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                                       logprob_chunk_size=chunk)))
    calls = []
    real = preference.models.map_time_chunks

    def spy(fn, hidden, targets, *, chunk_size, remat=False):
        calls.append((getattr(fn, "__qualname__", ""), chunk_size, hidden.shape[1]))
        return real(fn, hidden, targets, chunk_size=chunk_size, remat=remat)

    monkeypatch.setattr(preference.models, "map_time_chunks", spy)
    for name in ("wpo", "ld_mpo_wpo"):
        calls.clear()
        np.testing.assert_allclose(task_loss(chunked, CASES[name]), losses[name][1], rtol=2e-5, atol=2e-6)
        wpo_calls = [c for c in calls if "_pair_token_logps" in c[0]]
        assert wpo_calls and all(size == chunk < width for _, size, width in wpo_calls), calls
