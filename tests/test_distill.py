"""Distillation trainers end to end on the toy word model: the student learns a task from
the teacher's logits alone, and the teacher is refused when its tokenizer is not the student's."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from alignax import estimate
from alignax.config import ConfigError
from alignax.models import save_pretrained
from alignax.sampling.sampler import SamplingConfig, generate, left_pad
from alignax.trainers.api import load_config, train
from alignax.trainers.engine.setup import build_model
from alignax.trainers.offline import distill as distill_task
from tests.fake_devices import run_check
from tests.support.toy_model import make_toy_model
from tests.support.trainer_helpers import CONFIGS, WORDS, tiny_config

# The task: "what is W" is answered by the next word of the list after W. Learnable only from
# the mapping itself (no copying shortcut); a random model answers right about 1 time in 32.
ANSWER = {w: WORDS[(i + 1) % len(WORDS)] for i, w in enumerate(WORDS)}
PLACEHOLDER = "ok"  # the distillation records' responses: the same word whatever the question


def conversations(words, answer):
    return [{"messages": [{"role": "user", "content": f"what is {w}"},
                          {"role": "assistant", "content": answer(w)}]} for w in words]


def accuracy(model, tokenizer, words) -> float:
    """Share of ``words`` whose greedy first answer token is the task's answer."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"what is {w}"}],
                                             add_generation_prompt=True, tokenize=True) for w in words]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    tokens, mask = left_pad(prompts, pad_id=tokenizer.pad_token_id)
    graphdef, state = nnx.split(model)
    out = generate(graphdef, state, tokens, mask, jax.random.key(0),
                   config=SamplingConfig(max_new_tokens=1, greedy=True, stop_token_ids=(tokenizer.eos_token_id,),
                                         pad_id=tokenizer.pad_token_id))
    want = np.array([tokenizer.convert_tokens_to_ids(ANSWER[w]) for w in words])
    return float(np.mean(np.asarray(out.tokens[:, 0]) == want))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A two-layer toy model trained (SFT) on the task: ``(folder, its accuracy)``."""
    root = tmp_path_factory.mktemp("teacher")
    base = make_toy_model(root / "base", seed=3, layers=2)
    records = conversations(WORDS * 6, ANSWER.get)
    config = tiny_config(root / "run", "sft", steps=100, model_dir=base, checkpoint={"enabled": False},
                         optim={"learning_rate": 5e-3}, data={"eval_fraction": 0.0})
    result = train(config, records=records)
    folder = str(root / "export")
    save_pretrained(result.model, folder)
    result.tokenizer.save_pretrained(folder)
    return folder, accuracy(result.model, result.tokenizer, WORDS)


NOT_RANDOM = {"random_init": None, "seed": 0}  # the trained teacher, not the recipe's random one


def distill_config(tmp_path, student, teacher_dir, recipe="distill", data=(), **distill):
    return tiny_config(tmp_path, recipe, steps=100, model_dir=student, checkpoint={"enabled": False},
                       optim={"learning_rate": 5e-3}, data={"eval_fraction": 0.0, **dict(data)},
                       distill={"teacher": {"name": teacher_dir, **NOT_RANDOM}, **distill})


@pytest.mark.parametrize("recipe, distill", [
    ("distill", {"divergence": "forward_kl"}),
    ("distill", {"top_k": 4, "teacher_logits": "precomputed"}),
    # on-policy distillation: every step on the student's own samples, per-token reverse KL. One
    # sampled token a row: with more, the one-layer student spends its capacity matching the
    # teacher on its own random continuations (2 tokens: 0.36 after 100 steps; 1 token: 1.0)
    ("gkd", {"lmbda": 1.0, "divergence": "reverse_kl", "data": {"max_response_length": 1}}),
], ids=["live", "precomputed_top4", "on_policy_reverse_kl"])
def test_student_reaches_the_teachers_accuracy_from_its_logits(tmp_path, teacher, recipe, distill):
    teacher_dir, teacher_accuracy = teacher
    assert teacher_accuracy >= 0.9  # the teacher learnt the task
    student = make_toy_model(tmp_path / "student", seed=5, layers=1)  # smaller than the teacher
    config = distill_config(tmp_path / "run", student, teacher_dir, recipe, **distill)
    records = conversations(WORDS * 4, lambda w: PLACEHOLDER)  # the answers are in the teacher's logits only
    result = train(config, records=records)
    tokenizer = result.tokenizer
    before = accuracy(build_model(config.model), tokenizer, WORDS)
    after = accuracy(result.model, tokenizer, WORDS)
    assert before <= 0.2  # near chance
    print(f"{recipe} {distill}: student accuracy {before:.2f} -> {after:.2f}, teacher {teacher_accuracy:.2f}")
    assert after >= teacher_accuracy - 0.10, (before, after, teacher_accuracy)
    assert result.history[-1]["teacher_agreement"] > result.history[0]["teacher_agreement"]


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, teacher, toy_model):
    config = tiny_config(tmp_path, "distill", steps=1, model_dir=toy_model, checkpoint={"enabled": False},
                         distill={"teacher": {"name": "smollm2-135m-instruct",
                                              "random_init": {"num_hidden_layers": 1, "hidden_size": 32}}})
    with pytest.raises(ConfigError, match=rf"distill.teacher=smollm2-135m-instruct and model.name={toy_model} "
                                          "have different tokenizers"):
        train(config, records=conversations(WORDS, ANSWER.get))


def test_estimate_counts_the_teacher_at_its_own_size():
    config = load_config(os.path.join(CONFIGS, "tiny-distill.yaml"))
    teacher = build_model(config.distill.teacher)
    teacher_params = sum(x.size for x in jax.tree.leaves(nnx.state(teacher, nnx.Param)))
    student_params = sum(x.size for x in jax.tree.leaves(nnx.state(build_model(config.model), nnx.Param)))
    assert teacher_params > student_params  # the recipe's teacher is the larger model
    result = estimate.estimate(config, model=estimate.model_config_for(config), devices=1)
    assert result.items["reference"] == teacher_params * 4  # float32, one device
    precomputed = dataclasses.replace(config, distill=dataclasses.replace(config.distill, top_k=8,
                                                                          teacher_logits="precomputed"))
    assert estimate.estimate(precomputed, model=estimate.model_config_for(config), devices=1).items["reference"] == 0


def test_prompts_are_left_padded_from_the_rows_before_their_first_response_token():
    pad = 1
    batch = {"tokens": np.array([[5, 6, 7, 8, 9, 1], [4, 3, 2, 9, 1, 1], [7, 8, 9, 1, 1, 1]]),
             "response_mask": np.array([[0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])}
    tokens, mask = distill_task.left_padded_prompts(batch, 4, pad)
    np.testing.assert_array_equal(tokens, [[1, 5, 6, 7],   # prompt of 3
                                           [1, 1, 1, 4],   # prompt of 1
                                           [1, 1, 1, 7]])  # no response: its first token
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])
    tokens, mask = distill_task.left_padded_prompts(batch, 2, pad)  # too long: the prompt's last tokens
    np.testing.assert_array_equal(tokens[0], [6, 7])
    np.testing.assert_array_equal(mask[0], [1, 1])


def test_teacher_in_host_memory_gives_the_device_placed_losses(tmp_path, teacher, toy_model):
    records = conversations(WORDS, lambda w: PLACEHOLDER)
    losses = {}
    for where in ("device", "host"):
        config = distill_config(tmp_path / where, toy_model, teacher[0])
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, total_steps=3),
                                     placement=dataclasses.replace(config.placement, reference=where))
        losses[where] = [h["loss"] for h in train(config, records=records).history]
    assert losses["host"] == losses["device"] and losses["host"][0] > 0.5  # the trained teacher, far from the student


def test_gkd_mixes_on_policy_and_dataset_steps(tmp_path, teacher, toy_model):
    config = distill_config(tmp_path, toy_model, teacher[0], "gkd", lmbda=0.5, data={"max_response_length": 2})
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, total_steps=12))
    history = train(config, records=conversations(WORDS, lambda w: PLACEHOLDER)).history
    shares = [h["on_policy"] for h in history]
    assert set(shares) == {0.0, 1.0}, shares  # both kinds of step, one coin each


@pytest.mark.parametrize("recipe, distill", [("distill", {}), ("gkd", {"lmbda": 1.0, "divergence": "reverse_kl"})],
                         ids=["distill", "gkd_on_policy"])
def test_a_lora_student_steps_its_adapters_against_the_teacher_beside_its_base(tmp_path, toy_model, recipe, distill):
    """``lora:`` on the offline distillation tasks: the frozen inputs are the student's base and
    the teacher (a model of its own, two layers: not the base with the adapters off); with
    ``B = 0`` the first step's loss is the full-parameter run's (gkd: on the same samples
    drawn inside the step), and the step moves adapters only (the state holds nothing else,
    the base is bitwise the student's checkpoint, some ``B`` moved off zero)."""
    from alignax.models import from_pretrained
    from alignax.models.lora import LoRAParam
    from alignax.trainers.api import build_trainer

    teacher_dir = make_toy_model(tmp_path / "teacher", seed=7, layers=2)  # random: far from the student
    records = conversations(WORDS, ANSWER.get)
    losses = {}
    for name, lora in (("full", None), ("lora", {"rank": 2, "alpha": 4})):
        config = tiny_config(tmp_path / name, recipe, steps=1, model_dir=toy_model, checkpoint={"enabled": False},
                             data={"eval_fraction": 0.0, "max_response_length": 2}, lora=lora,
                             distill={"teacher": {"name": teacher_dir, **NOT_RANDOM}, **distill})
        result = train(config, records=records)
        losses[name] = result.history[0]["loss"]
    frozen = (trainer := build_trainer(config, records=records)).frozen_inputs(trainer.initial_reference())
    assert set(frozen) == {"base", "reference"}
    assert len(frozen["reference"]["model"]["layers"]) == 2 and len(frozen["base"]["model"]["layers"]) == 1
    np.testing.assert_allclose(losses["lora"], losses["full"], rtol=1e-6)
    assert losses["full"] > 0.01
    trained = result.loop.state.params
    assert all(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(trained))
    assert any(np.any(np.asarray(v[...]) != 0) for path, v in nnx.to_flat_state(trained) if path[-1] == "b")
    loaded = dict(nnx.to_flat_state(nnx.state(from_pretrained(toy_model), nnx.Param)))
    now = dict(nnx.to_flat_state(nnx.state(result.model, nnx.Param)))
    for path, value in loaded.items():  # bitwise: the trained model's base is the checkpoint's
        np.testing.assert_array_equal(np.asarray(now[path][...]), np.asarray(value[...]))


def test_a_teacher_on_a_submesh_steps_as_a_device_teacher():
    runs = run_check("distill_submesh_check.py")  # 8 fake devices: 4 train, the teacher on the other 4
    np.testing.assert_allclose(runs["submesh"]["loss"], runs["device"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(runs["submesh"]["teacher_agreement"], runs["device"]["teacher_agreement"])
    assert runs["device"]["loss"][0] > 0.1  # a random teacher, its own weights: far from the student
    assert runs["submesh"]["teacher_devices"] == [4, 5, 6, 7] and runs["device"]["teacher_devices"] == [0, 1, 2, 3]
    assert runs["submesh"]["frozen_keys"] == [] and runs["submesh"]["teacher_in_batch"] == ["topk_ids", "topk_logps"]


@pytest.mark.parametrize("recipe", ["distill", "gkd"])
def test_train_evaluate_export_through_the_api(tmp_path, teacher, recipe):
    """The map's rule (tests/test_api.py): every algorithm is trained, evaluated from its
    checkpoint and exported by a test. Two steps with checkpoints on and an eval split; the
    evaluation reads the saved step (its figures finite, the divergence among them) and the
    export is the student (safetensors with the student's one layer, not the teacher's two)."""
    from alignax.trainers.api import evaluate, export

    teacher_dir, _ = teacher
    student = make_toy_model(tmp_path / "student", seed=5, layers=1)
    config = tiny_config(tmp_path / "run", recipe, steps=2, model_dir=student, data={"eval_fraction": 0.25},
                         distill={"teacher": {"name": teacher_dir, **NOT_RANDOM}, "lmbda": 0.5})
    records = conversations(WORDS * 2, ANSWER.get)
    train(config, records=records)
    figures = evaluate(config, records=records)
    assert figures and all(np.isfinite(v) for v in figures.values()), figures
    assert any("divergence" in k for k in figures), figures
    out = export(config, str(tmp_path / "export"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1  # the student, not the teacher
