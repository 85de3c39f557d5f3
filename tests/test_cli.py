"""The ``alignax`` entrypoint as a user runs it: config errors, SIGTERM, resume."""

import os
import signal
import subprocess
import sys
import time

import yaml

from alignax.checkpoint import Checkpointer
from alignax.data import write_jsonl
from alignax.metrics import read_jsonl
from tests.support.trainer_helpers import separable_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_recipe(tmp_path, model_dir, **train):
    data_path = tmp_path / "pairs.jsonl"
    write_jsonl(separable_pairs(40), data_path)
    recipe = {
        "algorithm": "dpo",
        "output_dir": str(tmp_path / "run"),
        "model": {"name": model_dir},
        "data": {"paths": [str(data_path)], "format": "preference", "max_length": 32, "max_prompt_length": 24,
                 "batch_size": 8, "eval_fraction": 0.2},
        "train": {"total_steps": 4, "log_every": 1, **train},
        "logging": {"tensorboard": True},
        "mesh": {"shape": [1, 1, 1]},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def alignax(*args, **kwargs):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "alignax.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_unknown_and_ill_typed_keys_exit_2_naming_the_key(tmp_path, toy_model, capsys):
    recipe = write_recipe(tmp_path, toy_model)
    # once through the installed entrypoint as a user runs it (`python -m alignax.cli`) ...
    proc = alignax("train", str(recipe), "preference.betta=0.2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'preference.betta' (did you mean 'beta'?)" in err
    # ... and the same `main` in this process for the other errors
    code, err = run_cli(capsys, "train", str(recipe), "train.total_steps=many")
    assert code == 2 and "train.total_steps: expected an integer, got 'many'" in err
    code, err = run_cli(capsys, "train", str(recipe), "preference.loss=ppo")
    assert code == 2 and "preference.loss: 'ppo' is not a valid choice; valid: 'dpo', 'simpo'" in err


def test_sigterm_saves_a_checkpoint_and_a_rerun_resumes(tmp_path, toy_model, capsys):
    recipe = write_recipe(tmp_path, toy_model, total_steps=500)
    proc = alignax("train", str(recipe))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:
        if metrics.exists() and any(r.get("step", 0) >= 2 and "loss" in r for r in read_jsonl(str(metrics))):
            break
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM" in err
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"))
    stopped_at = ckpt.latest_step()
    ckpt.close()
    assert stopped_at is not None and 2 <= stopped_at < 500
    # The reruns go through the CLI in this process (the signal needed a process of its own;
    # what follows does not, and a second interpreter start costs more than the run).
    # A longer run moves the cosine schedule: refused (before any model loads) unless allowed.
    code, err = run_cli(capsys, "train", str(recipe), f"train.total_steps={stopped_at + 2}")
    assert code == 2, err[-3000:]
    assert f"train.total_steps: 500 -> {stopped_at + 2}" in err and "--allow-changes" in err
    assert "Traceback" not in err
    # the rerun continues from there rather than from 0
    code, err = run_cli(capsys, "train", str(recipe), f"train.total_steps={stopped_at + 2}", "--allow-changes")
    assert code == 0, err[-3000:]
    steps = [r["step"] for r in read_jsonl(str(metrics)) if "loss" in r]
    assert steps[-2:] == [stopped_at + 1, stopped_at + 2]
    assert os.listdir(tmp_path / "run" / "tensorboard")  # event files written


def test_kill_9_before_the_first_checkpoint_restarts_with_the_same_command(tmp_path, toy_model, capsys, caplog):
    """kill -9 before any checkpoint leaves config.yaml, metrics and a lock of a dead
    process: the rerun starts the run over instead of asking for --overwrite (which an
    automatic restart loop never passes)."""
    recipe = write_recipe(tmp_path, toy_model, total_steps=100_000, save_every=0)
    quiet = ("optim.schedule=constant", "logging.console=false", "logging.tensorboard=false")
    proc = alignax("train", str(recipe), *quiet)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and any(r.get("step", 0) >= 2 and "loss" in r for r in read_jsonl(str(metrics)))):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.kill()
    proc.communicate(timeout=60)
    run = tmp_path / "run"
    assert {"config.yaml", ".alignax.lock", "metrics.jsonl"} <= set(os.listdir(run))
    assert not [d for d in os.listdir(run / "checkpoints") if d.isdigit()]
    # the same run (a shorter one: under a constant schedule the length is not what is trained)
    code, err = run_cli(capsys, "train", str(recipe), *quiet, "train.total_steps=3")
    assert code == 0, err[-3000:]
    assert "no completed checkpoint to resume from, starting the run over" in caplog.text
    assert [r["step"] for r in read_jsonl(str(metrics)) if "loss" in r] == [1, 2, 3]  # from scratch, once


def test_a_full_disk_stops_the_run_in_one_line_exit_1(tmp_path, toy_model, capsys, caplog, monkeypatch):
    """The second checkpoint cannot be written (ENOSPC raised by Orbax's JSON writer in its
    background thread, as in tests/test_train_loop.py): exit 1 and one line naming the step,
    its folder and the last good step; Orbax's own error records lose their tracebacks
    (kept with --debug)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    write = json_checkpoint_handler.JsonCheckpointHandler._save_fn
    saves = []

    async def full_disk(self, item, directory):
        saves.append(directory)
        if len(saves) >= 2:
            raise OSError(28, "No space left on device", str(directory / "metadata"))
        return await write(self, item, directory)

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full_disk)
    recipe = write_recipe(tmp_path, toy_model, total_steps=6, save_every=1)
    code, err = run_cli(capsys, "train", str(recipe), "logging.console=false", "logging.tensorboard=false")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith(f"alignax: run stopped: writing checkpoint step 2 to {checkpoints / '2'} failed (OSError: "
                          "[Errno 28] No space left on device")
    assert f"the last complete checkpoint is step 1 ({checkpoints / '1'})" in err and len(err.splitlines()) == 1
    absl = [r for r in caplog.records if r.name == "absl" and r.levelname == "ERROR"]
    assert absl and not any(r.exc_info for r in absl)


def run_cli(capsys, *args):
    """``alignax ARGS`` in this process (faster than a subprocess): (exit status, stderr)."""
    from alignax import cli

    code = cli.main(list(args))
    return code, capsys.readouterr().err


def test_a_finished_run_is_neither_mixed_nor_lost(tmp_path, toy_model, capsys):
    recipe = write_recipe(tmp_path, toy_model, total_steps=2, save_every=1)
    quiet = ("logging.console=false", "logging.tensorboard=false")
    code, err = run_cli(capsys, "train", str(recipe), *quiet)
    assert code == 0, err[-3000:]
    run = tmp_path / "run"
    # resume=false on a directory holding a run: one line naming it, exit 2, nothing touched
    code, err = run_cli(capsys, "train", str(recipe), "checkpoint.resume=false")
    assert code == 2 and "Traceback" not in err
    assert f"alignax: error: {run} already holds a run (checkpoints at steps 1, 2)" in err
    assert "--overwrite" in err and "--debug shows the traceback" in err
    code, err = run_cli(capsys, "train", str(recipe), "checkpoint.resume=false", "--debug")
    assert code == 2 and "Traceback" in err
    # --step resumes from an earlier step: the newer ones are replaced by the rerun's
    code, err = run_cli(capsys, "train", str(recipe), "--step", "1", *quiet)
    assert code == 0, err[-3000:]
    steps = [r["step"] for r in read_jsonl(str(run / "metrics.jsonl")) if "loss" in r]
    assert steps == [1, 2, 2]
    # --overwrite replaces the run: fresh metrics from step 1
    code, err = run_cli(capsys, "train", str(recipe), "--overwrite", *quiet)
    assert code == 0, err[-3000:]
    steps = [r["step"] for r in read_jsonl(str(run / "metrics.jsonl")) if "loss" in r]
    assert steps == [1, 2]
