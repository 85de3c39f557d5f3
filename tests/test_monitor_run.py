"""The monitor in a run (alignax/trainers/online/guard.py, gold.py) on the toy model: through
``alignax train`` a gold-divergence alarm rolls back (learning rate and KL coefficient
changed from the next update), then stops with exit status 3 and one line, its checkpoint
saved; the gold scorer only ever sees the held-out prompts; a gold set sharing a prompt
with the training data is refused naming both records; the config checks of ``monitor:``."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from alignax import cli
from alignax import config as config_io
from alignax.config import ConfigError
from alignax.data import DataConfig, prepare_dataset, write_jsonl
from alignax.metrics import read_jsonl
from alignax.models import save_pretrained
from alignax.trainers.engine.setup import build_model
from alignax.trainers.api import load_config, train
from alignax.trainers.online.gold import GoldOverlapError, check_held_out
from tests.data.tiny_tokenizer import word_tokenizer
from tests.support.rl_toy import toy_config, toy_prompts, yes_share
from tests.support.toy_model import TOY_WORDS

pytestmark = pytest.mark.xdist_group("monitor_run")

GOLD_SEEN: list[str] = []


def _share_of(word):
    """A reward function counting ``word``: two calls make two closures with one qualified name."""
    def share(completions, references):
        del references
        return [sum(w == word for w in text.split()) / max(len(text.split()), 1) for text in completions]
    return share


yes_closure, no_closure = _share_of("yes"), _share_of("no")
yes_closure_alias = yes_closure


def gold_yes_share(completions, references):
    """The gold scorer of the run below: records every prompt it is shown."""
    GOLD_SEEN.extend(r["prompt"] for r in references)
    return yes_share(completions, references)


def gold_prompts(n: int) -> list[dict]:
    """Four-word prompts: never one of the toy's three-word training prompts."""
    return [{"prompt": " ".join(TOY_WORDS[(i + j) % len(TOY_WORDS)] for j in range(4)), "answer": "yes",
             "task": "toy"} for i in range(n)]


def test_rollback_then_stop_through_the_cli(tmp_path, toy_model, capsys):
    train_records, gold_records = toy_prompts(16), gold_prompts(4)
    write_jsonl(train_records, str(tmp_path / "train.jsonl"))
    write_jsonl(gold_records, str(tmp_path / "gold.jsonl"))
    monitor = {
        "gold": {"prompts": {"paths": [str(tmp_path / "gold.jsonl")], "format": "prompt", "max_prompt_length": 24,
                             "batch_size": 4},
                 "every": 1, "max_prompts": 4,
                 "rewards": {"verifier_weight": 0.0, "functions": {"tests.test_monitor_run:gold_yes_share": 1.0}}},
        # built to trip at every second gold point after a rollback: any drop, any rise
        "gold_divergence": {"action": "rollback", "window": 1, "min_gold_drop": float("-inf"),
                            "min_proxy_rise": float("-inf")},
        "rollback": {"max_rollbacks": 1, "lr_factor": 0.5, "kl_factor": 2.0},
    }
    config = toy_config(tmp_path / "run", toy_model, "grpo", steps=4, monitor=monitor,
                        data={"paths": [str(tmp_path / "train.jsonl")], "format": "prompt"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_io.to_dict(config)))
    GOLD_SEEN.clear()

    status = cli.main(["train", str(path)])

    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 3, err
    assert err.startswith("alignax: run stopped: monitor.gold_divergence.action=stop: step 3: the proxy reward rose")
    assert "max_rollbacks=1" in err
    run = tmp_path / "run"
    events = [json.loads(line) for line in open(run / "alarms.jsonl")]
    assert [(e["step"], e["action"]) for e in events] == [(1, "rollback"), (1, "rollback"), (3, "rollback"),
                                                          (3, "stop")]
    points = json.load(open(run / "gold.json"))["points"]
    assert [p["step"] for p in points] == [0, 1, 2, 3]
    best = max(points[:2], key=lambda p: p["gold"])  # the gold-best of the steps before the rollback (first on ties)
    assert events[1]["restored_step"] == best["step"]
    rows = {row["step"]: row for row in read_jsonl(str(run / "metrics.jsonl")) if "learning_rate" in row}
    assert rows[2]["learning_rate"] == pytest.approx(0.5 * rows[1]["learning_rate"])  # lr_factor from step 2 on
    assert rows[2]["kl_coef"] == pytest.approx(2.0 * rows[1]["kl_coef"])  # kl_factor (a fixed controller)
    assert rows[3]["guard/rollbacks"] == 1.0
    assert "3" in os.listdir(run / "checkpoints")  # the stop saved its step
    assert open(run / "gold.png", "rb").read(4) == b"\x89PNG"
    # the gold scorer saw the gold prompts, each time all of them, and never a training prompt
    assert GOLD_SEEN and set(GOLD_SEEN) == {r["prompt"] for r in gold_records}
    assert not set(GOLD_SEEN) & {r["prompt"] for r in train_records}


def test_a_resumed_run_keeps_its_rollbacks_and_learning_rate(tmp_path, toy_model):
    """Two steps (a rollback at step 1), then the same run resumed to three steps: the
    learning-rate factor of the first rollback is in force after the resume, and the second
    rollback counts on from the first (the monitor's state rides in the checkpoint's meta).
    The gold scorer is a process reward model (the toy trunk with a fresh score head; its
    numbers are checked in tests/test_best_of_n.py::test_a_prm_is_a_reward_component)."""
    write_jsonl(toy_prompts(16), str(tmp_path / "train.jsonl"))
    write_jsonl(gold_prompts(4), str(tmp_path / "gold.jsonl"))
    prm = build_model(toy_config(tmp_path / "unused", toy_model, "grpo", steps=1).model, kind="reward")
    save_pretrained(prm, str(tmp_path / "prm"))
    monitor = {
        "gold": {"prompts": {"paths": [str(tmp_path / "gold.jsonl")], "format": "prompt", "max_prompt_length": 24,
                             "batch_size": 4}, "every": 1, "max_prompts": 4,
                 "rewards": {"verifier_weight": 0.0, "prm": str(tmp_path / "prm"), "step_delimiter": "yes"}},
        "gold_divergence": {"action": "rollback", "window": 1, "min_gold_drop": float("-inf"),
                            "min_proxy_rise": float("-inf")},
        "rollback": {"max_rollbacks": 3, "lr_factor": 0.5},
    }

    def run(steps):
        config = toy_config(tmp_path / "run", toy_model, "grpo", steps=steps, monitor=monitor,
                            data={"paths": [str(tmp_path / "train.jsonl")], "format": "prompt"},
                            checkpoint={"allow_changes": True})
        return train(config)

    run(2)
    result = run(3)
    rows = {row["step"]: row for row in result.history}
    first = {row["step"]: row for row in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if "learning_rate" in row}
    assert rows[3]["learning_rate"] == pytest.approx(0.5 * first[1]["learning_rate"])  # the factor survived
    assert rows[3]["guard/rollbacks"] == 2.0
    events = [json.loads(line) for line in open(tmp_path / "run" / "alarms.jsonl")]
    assert [e["step"] for e in events if "restored_step" in e] == [1, 3]
    gold = [row for row in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if "gold/score" in row]
    assert len(gold) >= 4 and all(row["gold/score"] == row["gold/prm"] and 0 < row["gold/prm"] < 1 for row in gold)


def test_a_gold_set_sharing_a_training_prompt_is_refused(tmp_path):
    tokenizer = word_tokenizer()
    train_records = toy_prompts(8)
    write_jsonl(train_records, str(tmp_path / "train.jsonl"))
    write_jsonl(gold_prompts(3) + [train_records[5]], str(tmp_path / "gold.jsonl"))
    write_jsonl(gold_prompts(3), str(tmp_path / "held_out.jsonl"))

    def prepared(name):
        return prepare_dataset(DataConfig(paths=(str(tmp_path / name),), format="prompt", max_prompt_length=24,
                                          eval_fraction=0.0, shuffle=False), tokenizer)

    train = prepared("train.jsonl")
    check_held_out(prepared("held_out.jsonl"), train)  # disjoint: accepted
    with pytest.raises(GoldOverlapError) as info:
        check_held_out(prepared("gold.jsonl"), train)
    message = str(info.value)
    assert "gold.jsonl, line 4 has the same prompt as the training record" in message
    assert "train.jsonl, line 6" in message and "1 of the 4 gold prompts" in message
    assert message.startswith("monitor.gold.prompts: ")


def test_a_gold_prompt_is_a_training_prompt_under_another_template_or_spacing(tmp_path):
    """The same question is caught though its ids differ: the gold set adds a system prompt
    and spaces its words apart (the ids of the two prompts share no digest), or is a
    conversation whose user turn is the training prompt."""
    tokenizer = word_tokenizer()
    train_records = toy_prompts(8)
    write_jsonl(train_records, str(tmp_path / "train.jsonl"))
    twin = {**train_records[2], "prompt": "  " + train_records[2]["prompt"].replace(" ", "   ") + " "}
    write_jsonl(gold_prompts(3) + [twin], str(tmp_path / "spaced.jsonl"))
    chat = {"messages": [{"role": "system", "content": "Answer yes."},
                         {"role": "user", "content": train_records[7]["prompt"]}], "answer": "yes", "task": "toy"}
    others = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": "yes"} for r in gold_prompts(2)]
    write_jsonl([chat] + others, str(tmp_path / "chat.jsonl"))
    train = prepare_dataset(DataConfig(paths=(str(tmp_path / "train.jsonl"),), format="prompt", max_prompt_length=24,
                                       eval_fraction=0.0, shuffle=False), tokenizer)
    for name, line, train_line, field_map in (("spaced.jsonl", 4, 3, {}), ("chat.jsonl", 1, 8, {"prompt": "messages"})):
        gold = prepare_dataset(DataConfig(paths=(str(tmp_path / name),), format="prompt", max_prompt_length=24,
                                          eval_fraction=0.0, shuffle=False, system_prompt="Be brief.",
                                          field_map=field_map), tokenizer)
        twin_ids = gold.encoder.encode(gold.source[line - 1]).prompt
        assert twin_ids != train.encoder.encode(train.source[train_line - 1]).prompt  # not caught by the ids
        with pytest.raises(GoldOverlapError, match=rf"{name}, line {line} has the same prompt as the training record "
                                                   rf".*train.jsonl, line {train_line}"):
            check_held_out(gold, train)


GRPO = {"algorithm": "grpo", "data": {"format": "prompt"}, "output_dir": "runs/unused"}
GOLD = {"prompts": {"paths": ["reasoning_gym:chain_sum?size=8&seed=1000"], "format": "prompt"},
        "rewards": {"verifier_weight": 0.0, "functions": {"tests.support.rl_toy:yes_share": 1.0}}}


def refused(**sections) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data={**GRPO, **sections})
    return str(info.value)


def test_monitor_config_checks():
    assert "monitor.entropy_collapse.action=rollback restores the checkpoint whose gold score was best; set " \
           "monitor.gold.prompts" in refused(monitor={"entropy_collapse": {"action": "rollback"}})
    assert "monitor.gold.rewards is the training reward (rewards)" in refused(
        monitor={"gold": {"prompts": GOLD["prompts"]}})  # both the default reward config
    assert "monitor.rollback.lr_factor applies to an alarm whose action is rollback" in refused(
        monitor={"rollback": {"lr_factor": 0.1}})
    assert "monitor.gold.every applies to monitor.gold.prompts" in refused(monitor={"gold": {"every": 3}})
    assert "grpo.kl_coef is 0: a factor times 0 stays 0" in refused(
        grpo={"kl_coef": 0.0}, monitor={"kl_budget": {"max": 1.0, "action": "raise_beta"}})
    assert "monitor.kl_acceleration.window must be >= 1" in refused(monitor={"kl_acceleration": {"window": 0}})
    assert "monitor.clip_fraction.max must be >= 0" in refused(monitor={"clip_fraction": {"max": -0.1}})
    assert "monitor.no_signal.action applies to algorithm=" in refused(algorithm="dpo", data={"format": "preference"},
                                           monitor={"no_signal": {"action": "stop"}})
    config = load_config(data={**GRPO, "monitor": {"gold": GOLD, "entropy_collapse": {"action": "rollback"}}})
    assert config.monitor.entropy_collapse.action == "rollback"




def test_the_clip_fraction_alarm_is_refused_for_a_loss_without_a_clip():
    clip = {"clip_fraction": {"max": 0.2}}
    for section in ({"policy_loss": "dro", "dro_beta": 0.1}, {"policy_loss": "vespo"}, {"policy_loss": "kl_cov"},
                    {"policy_loss": "pg"}):
        message = refused(grpo=section, monitor=clip)
        assert message.startswith("monitor.clip_fraction.max applies to a policy loss that clips its ratio")
        assert f"got grpo.policy_loss={section['policy_loss']}" in message and "\n" not in message
    distill = {"algorithm": "onpolicy_distill", "distill": {"teacher": {"name": "smollm2-135m-instruct"}}}
    assert "got algorithm=onpolicy_distill, onpolicy_distill.estimator=exact" in refused(**distill, monitor=clip)
    # the clipping ones read it: PPO-clip and its kin in grpo, ppo, the sampled on-policy distillation
    for name in ("ppo", "gspo", "cispo", "dppo_tv", "clip_cov", "geo_mean"):
        assert load_config(data={**GRPO, "grpo": {"policy_loss": name}, "monitor": clip}).monitor.clip_fraction.max \
            == 0.2
    load_config(data={**GRPO, "algorithm": "ppo", "monitor": clip})
    load_config(data={**GRPO, **distill, "onpolicy_distill": {"estimator": "sampled"}, "monitor": clip})


def test_a_gold_scorer_the_training_reward_weighs_is_refused_under_any_name(tmp_path, monkeypatch):
    """Not only the same reward config: the same verifier beside other scorers, the same
    function under an alias (tests.test_monitor_run imports rl_toy's yes_share), the same
    judge, reward model or PRM under another spelling of its folder (a link, a relative
    path), GRPO's own process reward model."""
    yes = {"tests.support.rl_toy:yes_share": 1.0}
    message = refused(monitor={"gold": {**GOLD, "rewards": {"verifier_weight": 1.0, "functions": yes}}})
    assert message.startswith("monitor.gold.rewards.verifier_weight is the reasoning-gym answer verifier, which the "
                              "training reward weighs too (rewards.verifier_weight)") and "\n" not in message
    message = refused(rewards={"verifier_weight": 0.0, "functions": yes},
                      monitor={"gold": {**GOLD, "rewards": {"verifier_weight": 0.0,
                                                            "functions": {"tests.test_monitor_run:yes_share": 2.0}}}})
    assert ("monitor.gold.rewards.functions entry 'tests.test_monitor_run:yes_share' is the function "
            "tests.support.rl_toy:yes_share, which the training reward weighs too (rewards.functions entry "
            "'tests.support.rl_toy:yes_share')") in message
    judge = tmp_path / "judge"
    judge.mkdir()
    os.symlink(judge, tmp_path / "judge-link")
    monkeypatch.chdir(tmp_path)
    message = refused(rewards={"verifier_weight": 0.0, "judge_model": str(judge)},
                      monitor={"gold": {**GOLD, "rewards": {"verifier_weight": 0.0, "judge_model": "judge-link/"}}})
    assert (f"monitor.gold.rewards.judge_model 'judge-link/' is the model {os.path.realpath(judge)}, which the "
            f"training reward weighs too (rewards.judge_model '{judge}')") in message
    message = refused(rewards={"verifier_weight": 0.0, "reward_models": ["./judge"]},
                      monitor={"gold": {**GOLD, "rewards": {"verifier_weight": 0.0, "judge_model": str(judge)}}})
    assert "rewards.reward_models entry './judge'" in message
    # a PRM: the training reward's, or the algorithm's own (GRPO's process rewards)
    message = refused(rewards={"verifier_weight": 0.0, "prm": "judge"},
                      monitor={"gold": {**GOLD, "rewards": {"verifier_weight": 0.0, "prm": "judge-link"}}})
    assert "monitor.gold.rewards.prm 'judge-link' is the model" in message and "(rewards.prm 'judge')" in message
    message = refused(grpo={"advantage": "process", "process_reward_model": "judge"},
                      monitor={"gold": {**GOLD, "rewards": {"verifier_weight": 0.0, "prm": str(judge)}}})
    assert "which the training reward weighs too (grpo.process_reward_model)" in message
    # scorers apart: accepted (a function of the gold's own, the training reward's verifier)
    load_config(data={**GRPO, "monitor": {"gold": {**GOLD, "rewards": {
        "verifier_weight": 0.0, "functions": {"tests.test_monitor_run:gold_yes_share": 1.0}}}}})
    # closures of one factory are different functions (one qualified name); an alias of one is the same
    closures = {"verifier_weight": 0.0, "functions": {"tests.test_monitor_run:yes_closure": 1.0}}
    load_config(data={**GRPO, "rewards": closures, "monitor": {"gold": {**GOLD, "rewards": {
        "verifier_weight": 0.0, "functions": {"tests.test_monitor_run:no_closure": 1.0}}}}})
    message = refused(rewards=closures, monitor={"gold": {**GOLD, "rewards": {
        "verifier_weight": 0.0, "functions": {"tests.test_monitor_run:yes_closure_alias": 1.0}}}})
    assert "monitor.gold.rewards.functions entry 'tests.test_monitor_run:yes_closure_alias' is the object " \
           "tests.test_monitor_run:_share_of.<locals>.share at 0x" in message
    # on-policy distillation follows its teacher and only logs rewards: the verifier may be its gold, and the
    # rewards section itself too
    distill = {"algorithm": "onpolicy_distill", "distill": {"teacher": {"name": "smollm2-135m-instruct"}}}
    for gold_rewards in ({"verifier_weight": 1.0, "format_weight": 0.5}, {}):
        config = load_config(data={**GRPO, **distill, "monitor": {"gold": {**GOLD, "rewards": gold_rewards}}})
        assert config.monitor.gold.prompts is not None


@pytest.mark.slow  # the tool's two arms; the rollback in a run is covered fast above
def test_the_guarded_study_runs_both_arms_on_the_toy_model(tmp_path, toy_model):
    from tests.support.tools import load_tool

    tool = load_tool("studies/guarded_overoptimisation.py", "guarded_overoptimisation_tool")
    write_jsonl(toy_prompts(24) + gold_prompts(8), str(tmp_path / "prompts.jsonl"))
    args = tool.parse_args([
        "--out", str(tmp_path / "out"), "--model", toy_model, "--prompts", str(tmp_path / "prompts.jsonl"),
        "--gold-function", "tests.support.rl_toy:yes_share", "--max-prompt-length", "24", "--max-new-tokens", "6",
        "--batch-size", "4", "--pair-prompts", "16", "--gold-prompts", "4", "--rm-steps", "4", "--rm-lr", "1e-2",
        "--rl-steps", "4", "--rl-lr", "2e-2", "--gold-every", "1", "--kl-coef", "0.01"])
    report = tool.run(args)
    assert set(report["arms"]) == {"warn", "rollback"}
    for arm in report["arms"].values():
        assert [p["step"] for p in arm["points"]][0] == 0 and os.path.exists(arm["png"])
    assert report["arms"]["warn"]["rollbacks"] == 0
    assert all(e["action"] == "warn" for e in report["arms"]["warn"]["events"])
    rollback = report["arms"]["rollback"]
    assert all(e["action"] in ("rollback", "stop") for e in rollback["events"])
    assert rollback["rollbacks"] == sum("restored_step" in e for e in rollback["events"])
    # the held-out gold set shares no prompt with the training prompts
    gold = {json.loads(line)["prompt"] for line in open(os.path.join(args.out, "gold.jsonl"))}
    train = {json.loads(line)["prompt"] for line in open(os.path.join(args.out, "train.jsonl"))}
    assert len(gold) == 4 and not gold & train
