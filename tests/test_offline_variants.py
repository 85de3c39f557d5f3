"""What each offline preference loss does differently, checked through the trainer's task.

For every DPO variant, SimPO, CPO, ORPO and KTO, the loss of the trainer's task
(``alignax.trainers.offline.preference.make_task(...).loss_fn``: data pipeline batch,
packed or windowed forward passes, the loss wiring) on one batch equals the paper's
formula evaluated here in NumPy (float64, ``tests.support.references`` scalars) on sequence
log-probs that this file computes on its own, from full-vocabulary logits of the toy
model row by row. Policy and reference are the initial model with two different draws of
fixed noise added to its weights, so the implicit rewards are not zero (and of both
signs) and the variants really differ: each is asserted to differ from the sigmoid
default by a clear margin.

Also: KTO's live and precomputed references agree on a shuffled batch (the mismatched
KL rows are paired by record), and dpo.* keys that the chosen loss never reads are an
error naming them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.trainers.api import build_trainer
from alignax.trainers.config import PreferenceSection
from alignax.trainers.offline import preference
from tests.support.compiled import jitted
from tests.support.references import dpo_pair_loss, log_sigmoid, mean, sigmoid
from tests.support.trainer_helpers import perturbed, separable_pairs, tiny_config, unpaired_feedback

# The tests share module fixtures (built once per worker): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("offline-variants")

BETA = 0.5
NOISE = 0.1  # std of the weight perturbations
PAIR_SEEDS = (2, 3)  # policy's and reference's noise: margins of both signs, DPOP's penalty on some pairs
KTO_SEEDS = (2, 1)  # a positive KL reference point on the KTO batch (for the toy model as it is)
WINDOW = 8  # data.max_response_length < the rows: pairs are packed, KTO rows windowed


def sequence_logps(trainer, params, batch, prefix):
    """Summed log-probs of the response tokens and their counts, ``[B]`` float64, from a
    plain forward pass with full logits (no window, no packing)."""
    model = jitted(trainer.model_from(params))
    tokens = np.asarray(batch[f"{prefix}tokens"])
    logits = np.asarray(model(tokens, batch[f"{prefix}positions"], batch[f"{prefix}attention_mask"]).logits,
                        np.float64)
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token_logps = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    mask = np.asarray(batch[f"{prefix}response_mask"])[:, 1:] > 0
    return np.where(mask, token_logps, 0.0).sum(1), mask.sum(1).astype(np.float64)


# --------------------------------------------------------------------------- the papers' formulas


def pair_loss(variant, pc, pr, rc, rr, lc, lr, *, beta, eps, lam):
    """One pair's loss (``tests.support.references.dpo_pair_loss``); IPO reads length-averaged
    log-probs (TRL's IPO), every other variant the summed ones."""
    if variant == "ipo":
        pc, rc, pr, rr = pc / lc, rc / lc, pr / lr, rr / lr
    return dpo_pair_loss(variant, pc, pr, rc, rr, beta=beta, eps=eps, lam=lam)


def reference_loss(section: dict, logps: dict) -> float:
    """The loss of a ``dpo`` section on the batch's log-probs, by the papers' formulas."""
    s = dataclasses.replace(PreferenceSection(), **section)
    pc, pr, rc, rr, lc, lr = (logps[k] for k in ("pc", "pr", "rc", "rr", "lc", "lr"))
    n = len(pc)
    nll = -sum(pc) / sum(lc)  # token-mean NLL of the chosen responses (CPO, ORPO)
    if s.loss == "dpo":
        return mean(pair_loss(s.variant, pc[i], pr[i], rc[i], rr[i], lc[i], lr[i], beta=s.beta,
                                  eps=s.label_smoothing, lam=s.dpop_lambda) for i in range(n))
    if s.loss == "simpo":  # Meng et al. 2024 eq. 6
        zs = [s.beta * (pc[i] / lc[i] - pr[i] / lr[i]) - s.simpo_gamma for i in range(n)]
        return mean(-(1 - s.label_smoothing) * log_sigmoid(z) - s.label_smoothing * log_sigmoid(-z) for z in zs)
    if s.loss == "cpo":  # Xu et al. 2024
        return mean(-log_sigmoid(s.beta * (pc[i] - pr[i])) for i in range(n)) + s.cpo_alpha * nll
    if s.loss == "orpo":  # Hong et al. 2024 eq. 6-7, odds of the length-averaged probability

        def log_odds(x):
            return x - math.log(1 - math.exp(x))

        ratios = [log_odds(pc[i] / lc[i]) - log_odds(pr[i] / lr[i]) for i in range(n)]
        return nll + s.beta * mean(-log_sigmoid(r) for r in ratios)
    raise ValueError(s.loss)


def kto_reference(section: dict, logps: dict) -> tuple[float, float]:
    """KTO (Ethayarajh et al. 2024): ``(loss, z)`` with ``z = max(0, mean(KL rows' log-ratios))``."""
    s = dataclasses.replace(PreferenceSection(loss="kto"), **section)
    z = max(0.0, mean(a - b for a, b in zip(logps["kl_policy"], logps["kl_ref"])))
    losses = []
    for p, r, label in zip(logps["policy"], logps["ref"], logps["label"]):
        reward = p - r
        if label:
            losses.append(s.kto_desirable_weight * (1 - sigmoid(s.beta * (reward - z))))
        else:
            losses.append(s.kto_undesirable_weight * (1 - sigmoid(s.beta * (z - reward))))
    return mean(losses), z


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pairs(toy_model, tmp_path_factory):
    """The DPO trainer's pieces, one batch, policy/reference params and their log-probs."""
    # reference: precomputed, so that the trainer's task can precompute tables; the live
    # reference's tasks are made by task_loss.
    config = tiny_config(tmp_path_factory.mktemp("variants"), "dpo", model_dir=toy_model,
                         data={"max_response_length": WINDOW}, preference={"beta": BETA, "reference": "precomputed"})
    trainer = build_trainer(config, records=separable_pairs(16))
    batch = next(trainer.data.iterator("train"))
    assert batch["chosen_tokens"].shape == (8, 32) and "prompt_length" in batch
    policy, reference = (perturbed(trainer.params, scale=NOISE, seed=PAIR_SEEDS[0]),
                         perturbed(trainer.params, scale=NOISE, seed=PAIR_SEEDS[1]))
    pc, lc = sequence_logps(trainer, policy, batch, "chosen_")
    pr, lr = sequence_logps(trainer, policy, batch, "rejected_")
    rc, _ = sequence_logps(trainer, reference, batch, "chosen_")
    rr, _ = sequence_logps(trainer, reference, batch, "rejected_")
    logps = dict(pc=pc, pr=pr, rc=rc, rr=rr, lc=lc, lr=lr)
    return dict(config=config, trainer=trainer, batch=trainer.placer(batch), policy=policy, reference=reference,
                logps=logps)


def task_loss(setup, section: dict, frozen=None):
    config = setup["config"]
    section = {"reference": "live", **section}
    if section.get("loss") in ("simpo", "cpo", "orpo"):  # reference-free: precomputed does not apply
        section["reference"] = "live"
    config = dataclasses.replace(config, preference=dataclasses.replace(config.preference, **section))
    trainer = setup["trainer"]
    task = preference.make_task(config, trainer.graphdef, trainer.rest)
    if frozen is None:
        frozen = {"reference": setup["reference"]} if task.uses_reference else {}
    batch = setup["batch"]
    loss, metrics = task.loss_fn(setup["policy"], frozen, batch, task.normalisers_fn(batch), None)
    return float(loss), {k: float(v) for k, v in metrics.items()}


CASES = {
    "sigmoid": {},
    "cdpo": {"label_smoothing": 0.2},
    "hinge": {"variant": "hinge"},
    "ipo": {"variant": "ipo"},
    "robust": {"variant": "robust", "label_smoothing": 0.2},
    "dpop": {"variant": "dpop"},
    "exo_pair": {"variant": "exo_pair"},
    "nca_pair": {"variant": "nca_pair"},
    "sppo_hard": {"variant": "sppo_hard"},
    "apo_zero": {"variant": "apo_zero"},
    "apo_down": {"variant": "apo_down"},
    "simpo": {"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.3},
    "cpo": {"loss": "cpo", "cpo_alpha": 0.5},
    "orpo": {"loss": "orpo"},
}


@pytest.fixture(scope="module")
def losses(pairs):
    """Every case's task loss and formula value on the one batch."""
    out = {}
    for name, section in CASES.items():
        section = {"beta": BETA, **section}
        out[name] = (task_loss(pairs, section)[0], reference_loss(section, pairs["logps"]))
    return out


# --------------------------------------------------------------------------- tests


def test_the_reference_differs_from_the_policy(pairs):
    logps = pairs["logps"]
    chosen, rejected = logps["pc"] - logps["rc"], logps["pr"] - logps["rr"]
    assert np.abs(chosen - rejected).mean() > 0.5  # margins far from 0: the variants spread out
    assert (chosen > rejected).any() and (chosen < rejected).any()
    assert (logps["rc"] > logps["pc"]).any() and (logps["rc"] < logps["pc"]).any()  # DPOP's penalty on some pairs


@pytest.mark.parametrize("name", list(CASES))
def test_first_step_loss_is_the_papers_formula(losses, name):
    ours, formula = losses[name]
    np.testing.assert_allclose(ours, formula, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", [n for n in CASES if n != "sigmoid"])
def test_each_variant_differs_from_the_sigmoid_default(losses, name):
    sigmoid_loss = losses["sigmoid"][1]
    assert abs(losses[name][1] - sigmoid_loss) > 0.01, (name, losses[name][1], sigmoid_loss)
    assert abs(losses[name][0] - losses["sigmoid"][0]) > 0.01


def test_all_cases_are_distinct(losses):
    values = sorted(formula for _, formula in losses.values())
    assert min(np.diff(values)) > 1e-3, {k: v[1] for k, v in losses.items()}


def test_hyper_parameters_reach_the_loss(pairs):
    """beta, dpop_lambda, simpo_gamma, cpo_alpha: a changed value moves the loss as the formula says."""
    for section in ({"beta": 0.2}, {"variant": "dpop", "dpop_lambda": 5.0},
                    {"variant": "exo_pair", "label_smoothing": 0.3}, {"loss": "simpo", "simpo_gamma": 1.5},
                    {"loss": "cpo", "cpo_alpha": 2.0}, {"loss": "orpo", "beta": 0.7}):
        section = {"beta": BETA, **section}
        ours = task_loss(pairs, section)[0]
        np.testing.assert_allclose(ours, reference_loss(section, pairs["logps"]), rtol=2e-5, atol=2e-6)
        base = {k: v for k, v in section.items() if k in ("loss", "variant")}
        assert abs(ours - task_loss(pairs, {"beta": BETA, **base})[0]) > 1e-3, section


def test_precomputed_reference_gives_the_live_loss_for_pairs(pairs):
    trainer = pairs["trainer"]
    tables = trainer.precompute_reference(pairs["reference"])
    for section in ({}, {"variant": "ipo"}):
        live = task_loss(pairs, section)
        pre = task_loss(pairs, {**section, "reference": "precomputed"}, frozen=tables)
        np.testing.assert_allclose(pre[0], live[0], rtol=1e-5)


# --------------------------------------------------------------------------- KTO


@pytest.fixture(scope="module")
def kto(toy_model, tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("kto"), "kto", model_dir=toy_model,
                         data={"max_response_length": WINDOW}, preference={"beta": BETA, "reference": "precomputed"})
    assert config.data.shuffle
    trainer = build_trainer(config, records=unpaired_feedback(24))
    batch = next(trainer.data.iterator("train"))  # a shuffled batch
    assert not np.array_equal(np.sort(batch["record_index"]), batch["record_index"])
    policy, reference = (perturbed(trainer.params, scale=NOISE, seed=KTO_SEEDS[0]),
                         perturbed(trainer.params, scale=NOISE, seed=KTO_SEEDS[1]))
    logps = {
        "policy": sequence_logps(trainer, policy, batch, "")[0],
        "ref": sequence_logps(trainer, reference, batch, "")[0],
        "kl_policy": sequence_logps(trainer, policy, batch, "kl_")[0],
        "kl_ref": sequence_logps(trainer, reference, batch, "kl_")[0],
        "label": batch["label"].tolist(),
    }
    return dict(config=config, trainer=trainer, batch=trainer.placer(batch), policy=policy, reference=reference,
                logps=logps)


@pytest.mark.parametrize("section", [{}, {"kto_desirable_weight": 1.33}, {"kto_undesirable_weight": 0.5, "beta": 0.5}],
                         ids=["default", "desirable_weight", "undesirable_weight"])
def test_kto_loss_and_reference_point_are_the_papers(kto, section):
    loss, metrics = task_loss(kto, {"beta": BETA, **section})
    want, z = kto_reference({"beta": BETA, **section}, kto["logps"])
    assert z > 1e-3  # the mismatched KL rows give a non-zero reference point here
    np.testing.assert_allclose(metrics["kl"], z, rtol=1e-4)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=2e-6)
    without_z, _ = kto_reference({"beta": BETA, **section}, {**kto["logps"], "kl_policy": kto["logps"]["kl_ref"]})
    assert abs(want - without_z) > 1e-4  # the reference point matters
    if section:
        assert abs(loss - task_loss(kto, {"beta": BETA})[0]) > 1e-3


def test_kto_precomputed_reference_matches_live_on_a_shuffled_batch(kto):
    """Reference log-probs precomputed per record in file order pair with the very KL rows
    the policy scores in a shuffled batch: same loss and same reference point."""
    tables = kto["trainer"].precompute_reference(kto["reference"])
    live_loss, live = task_loss(kto, {})
    pre_loss, pre = task_loss(kto, {"reference": "precomputed"}, frozen=tables)
    assert live["kl"] > 1e-3
    np.testing.assert_allclose(pre["kl"], live["kl"], rtol=1e-5)
    np.testing.assert_allclose(pre_loss, live_loss, rtol=1e-5)


# --------------------------------------------------------------------------- keys a loss cannot use


UNUSABLE = [
    ({"loss": "orpo", "label_smoothing": 0.1}, ["label_smoothing"]),
    ({"loss": "kto", "label_smoothing": 0.1}, ["label_smoothing"]),
    ({"loss": "dpo", "variant": "hinge", "label_smoothing": 0.1}, ["label_smoothing"]),
    ({"loss": "dpo", "simpo_gamma": 1.0}, ["simpo_gamma"]),
    ({"loss": "simpo", "cpo_alpha": 0.5}, ["cpo_alpha"]),
    ({"loss": "dpo", "kto_desirable_weight": 1.2, "kto_undesirable_weight": 0.8},
     ["kto_desirable_weight", "kto_undesirable_weight"]),
    ({"loss": "cpo", "variant": "ipo"}, ["variant"]),
    ({"loss": "dpo", "variant": "ipo", "dpop_lambda": 10.0}, ["dpop_lambda"]),
    ({"loss": "simpo", "reference": "precomputed"}, ["reference"]),
    ({"loss": "orpo", "variant": "robust", "label_smoothing": 0.1, "reference": "precomputed", "simpo_gamma": 0.1},
     ["variant", "label_smoothing", "simpo_gamma", "reference"]),
]


@pytest.mark.parametrize("section, keys", UNUSABLE, ids=[str(i) for i in range(len(UNUSABLE))])
def test_keys_the_loss_ignores_are_an_error_naming_them(tmp_path, section, keys):
    # Load-time validation (alignax.trainers.validation) refuses them before a model is read.
    recipe = "kto" if section["loss"] == "kto" else "dpo"
    with pytest.raises(ConfigError) as info:
        tiny_config(tmp_path, recipe, preference=section)
    for key in keys:
        assert f"preference.{key}" in str(info.value)


@pytest.mark.parametrize("section", [
    {"loss": "dpo", "variant": "robust", "label_smoothing": 0.1},
    {"loss": "dpo", "variant": "exo_pair", "label_smoothing": 0.1, "reference": "precomputed"},
    {"loss": "dpo", "variant": "dpop", "dpop_lambda": 10.0},
    {"loss": "simpo", "simpo_gamma": 1.0, "label_smoothing": 0.1},
    {"loss": "cpo", "cpo_alpha": 0.5, "label_smoothing": 0.1},
    {"loss": "orpo", "beta": 0.3},
])
def test_keys_the_loss_reads_are_accepted(tmp_path, section):
    assert tiny_config(tmp_path, "dpo", preference=section).preference.loss == section["loss"]
