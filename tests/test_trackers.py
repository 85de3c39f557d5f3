"""Experiment trackers (``logging.wandb``, ``logging.mlflow``) offline: what they hold is what
``metrics.jsonl`` holds, the run's config is logged, and a resumed run logs into the same
tracker run."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil

import pytest

from alignax.config import ConfigError
from alignax.metrics import read_jsonl
from alignax.trackers import TRACKER_IDS, SentLog, _import, flat
from alignax.trainers.api import train
from alignax.trainers.engine.session import Session
from tests.support import wandb_log
from tests.support.trainer_helpers import sft_conversations, tiny_config

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

TRACKERS = {"wandb": {"mode": "offline", "project": "alignax-test"}, "mlflow": {"experiment": "alignax-test"}}


def _run(tmp_path, toy_model, steps, **extra):
    config = tiny_config(tmp_path, "sft", model_dir=toy_model, steps=steps, train={"save_every": 2, "eval_every": 2},
                         logging={"console": False, "tensorboard": False, **TRACKERS}, **extra)
    train(config, records=sft_conversations(24))
    return config


def _wandb_file(output_dir):
    files = glob.glob(os.path.join(output_dir, "wandb", "*run-*", "run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def _wandb_steps(output_dir, run_id, key):
    """Every step at which ``key`` was logged to wandb run ``run_id``, over all its process starts."""
    files = glob.glob(os.path.join(output_dir, "wandb", "*run-*", f"run-{run_id}.wandb"))
    return sorted(int(h["_step"]) for f in files for h in wandb_log.history(f) if key in h)


def _mlflow(output_dir):
    from mlflow.tracking import MlflowClient

    with open(os.path.join(output_dir, TRACKER_IDS)) as f:
        ids = json.load(f)
    return MlflowClient(tracking_uri="file://" + os.path.abspath(os.path.join(output_dir, "mlruns"))), ids


def _by_step(rows, key):
    return {int(r["step"]): r[key] for r in rows if key in r}


def test_both_trackers_hold_every_figure_of_metrics_jsonl_and_the_config(tmp_path, toy_model):
    config = _run(tmp_path / "run", toy_model, 4)
    jsonl = read_jsonl(os.path.join(config.output_dir, "metrics.jsonl"))
    losses, eval_nll = _by_step(jsonl, "loss"), _by_step(jsonl, "eval/nll")
    assert sorted(losses) == [1, 2, 3, 4] and eval_nll  # training and eval figures

    history = wandb_log.history(_wandb_file(config.output_dir))
    logged = {int(h["_step"]): h for h in history}
    assert {s: logged[s]["loss"] for s in losses} == pytest.approx(losses, rel=1e-6)
    assert {s: logged[s]["eval/nll"] for s in eval_nll} == pytest.approx(eval_nll, rel=1e-6)
    wb_config = wandb_log.config(_wandb_file(config.output_dir))
    assert wb_config["optim.learning_rate"] == config.optim.learning_rate and wb_config["algorithm"] == "sft"

    client, ids = _mlflow(config.output_dir)
    got = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "loss")}
    assert got == pytest.approx(losses, rel=1e-6)
    got = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "eval/nll")}
    assert got == pytest.approx(eval_nll, rel=1e-6)
    params = client.get_run(ids["mlflow"]).data.params
    assert float(params["optim.learning_rate"]) == config.optim.learning_rate and params["algorithm"] == "sft"


def test_a_resumed_run_logs_into_the_same_tracker_runs(tmp_path, toy_model):
    out = tmp_path / "run"
    first = _run(out, toy_model, 2)
    with open(os.path.join(first.output_dir, TRACKER_IDS)) as f:
        ids = json.load(f)
    second = _run(out, toy_model, 4)  # the same command with more steps: resumes at step 2
    with open(os.path.join(second.output_dir, TRACKER_IDS)) as f:
        assert json.load(f) == ids
    client, _ = _mlflow(second.output_dir)
    assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], "loss")) == [1, 2, 3, 4]
    assert len(client.search_runs([client.get_run(ids["mlflow"]).info.experiment_id])) == 1
    # wandb keeps one folder per process start of the run id; both name the same run
    assert _wandb_steps(second.output_dir, ids["wandb"], "loss") == [1, 2, 3, 4]


def test_flat_dotted_keys_and_a_missing_package_named(monkeypatch):
    assert flat({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": None}
    with pytest.raises(ConfigError, match=r"logging.wandb needs the no_such_tracker package, which is not installed: "
                                          r"pip install 'alignax\[trackers\]'"):
        _import("no_such_tracker", "logging.wandb")


def test_steps_a_resumed_run_repeats_are_not_sent_to_the_trackers_twice(tmp_path, toy_model):
    """A run that stopped after step 4's figures went out but before its checkpoint was written
    resumes at step 2 and repeats steps 3 and 4 exactly: the trackers receive them once."""
    out = tmp_path / "run"
    first = _run(out, toy_model, 4)
    with open(os.path.join(first.output_dir, TRACKER_IDS)) as f:
        ids = json.load(f)
    sent = read_jsonl(os.path.join(first.output_dir, "mlflow_sent.jsonl"))
    assert [int(r["step"]) for r in sent if "loss" in r] == [1, 2, 3, 4]
    shutil.rmtree(os.path.join(first.output_dir, "checkpoints", "4"))  # the stop came before step 4's save
    second = _run(out, toy_model, 4)
    jsonl = read_jsonl(os.path.join(second.output_dir, "metrics.jsonl"))
    assert [int(r["step"]) for r in jsonl if "loss" in r].count(3) >= 1  # the resumed run did repeat step 3
    client, _ = _mlflow(second.output_dir)
    for key in ("loss", "eval/nll"):
        steps = [m.step for m in client.get_metric_history(ids["mlflow"], key)]
        assert sorted(steps) == sorted(set(steps)), (key, steps)  # each step once
    assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], "loss")) == [1, 2, 3, 4]
    assert _wandb_steps(second.output_dir, ids["wandb"], "loss") == [1, 2, 3, 4]
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"


def test_a_resumed_run_sends_what_the_tracker_lacks_or_holds_with_another_value(tmp_path):
    log = SentLog(str(tmp_path), "mlflow")
    log.record(2, log.unsent(2, {"loss": 0.5}))
    log.record(3, log.unsent(3, {"loss": 1.0, "nan": float("nan")}))
    log.close()  # the process stopped after step 3's loss, before its eval
    resumed = SentLog(str(tmp_path), "mlflow")
    assert resumed.unsent(2, {"loss": 0.5}) == {}  # repeated exactly: not sent again
    assert resumed.unsent(3, {"loss": 1.0, "nan": float("nan")}) == {}
    assert resumed.unsent(3, {"eval/nll": 2.0}) == {"eval/nll": 2.0}  # the rest of a step cut short
    assert resumed.unsent(2, {"loss": 0.25}) == {"loss": 0.25}  # a resume with changes: new values go out
    assert resumed.unsent(4, {"loss": 0.9}) == {"loss": 0.9}
    resumed.close()


@pytest.mark.parametrize("raised, status, exit_code", [(None, "FINISHED", 0), (RuntimeError, "FAILED", 1),
                                                         (KeyboardInterrupt, "KILLED", 1)])
def test_tracker_runs_end_as_the_run_did(tmp_path, toy_model, raised, status, exit_code):
    config = tiny_config(tmp_path, "sft", model_dir=toy_model, steps=1,
                         logging={"console": False, "tensorboard": False, **TRACKERS})
    with contextlib.suppress(RuntimeError, KeyboardInterrupt):
        with Session(config, console_keys=()) as session:
            session.writer.write(1, {"loss": 1.0})
            if raised is not None:
                raise raised("stopped")
    client, ids = _mlflow(config.output_dir)
    assert client.get_run(ids["mlflow"]).info.status == status
    assert wandb_log.exit_code(_wandb_file(config.output_dir)) == exit_code
