"""The run directory: one run at a time, nothing lost on a rerun, config changes named."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from alignax import config as config_io
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import rundir
from alignax.trainers.engine.rundir import RunDirectoryError, claim


def make_config(tmp_path, **checkpoint):
    extra = checkpoint.pop("extra", {})
    raw = {"algorithm": "sft", "output_dir": str(tmp_path / "run"), "model": {"name": "unused"},
           "data": {"paths": ["unused.jsonl"], "format": "sft"}, "checkpoint": checkpoint}
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return config_io.from_dict(TrainConfig, raw)


def fake_run(config, steps=(2, 4)):
    """What a run leaves: config.yaml, metrics, checkpoint step folders."""
    with claim(config) as directory:
        directory.write_config()
    for step in steps:
        os.makedirs(os.path.join(config.output_dir, "checkpoints", str(step)))
    with open(os.path.join(config.output_dir, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 1.0}\n')


def test_a_second_run_on_the_directory_is_refused_naming_the_holder(tmp_path):
    config = make_config(tmp_path)
    with claim(config):
        lock = json.loads((tmp_path / "run" / rundir.LOCK_NAME).read_text())
        assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname()
        with claim(config):  # re-entrant in this process (api.train, then the session)
            pass
        assert (tmp_path / "run" / rundir.LOCK_NAME).exists()
        # another process on the same directory
        code = ("import sys; from alignax.trainers.engine.rundir import claim; import tests.test_run_directory as t;"
                "import pathlib; c = t.make_config(pathlib.Path(sys.argv[1]))\n"
                "with claim(c): pass")
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode != 0
        assert f"is in use by another run (host {socket.gethostname()}, pid {os.getpid()}" in proc.stderr
    assert not (tmp_path / "run" / rundir.LOCK_NAME).exists()  # released


def test_a_stale_lock_is_taken_over(tmp_path, caplog):
    config = make_config(tmp_path)
    os.makedirs(config.output_dir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_path = tmp_path / "run" / rundir.LOCK_NAME
    lock_path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}))
    with claim(config):
        assert json.loads(lock_path.read_text())["pid"] == os.getpid()
    assert f"process {dead.pid} on this host has exited" in caplog.text
    # another host's lock: stale once its heartbeat is old
    lock_path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "earlier"}))
    with pytest.raises(RunDirectoryError, match="host elsewhere, pid 1"):
        with claim(config):
            pass
    old = os.path.getmtime(lock_path) - rundir.STALE_AFTER_S - 5
    os.utime(lock_path, (old, old))
    with claim(config):
        pass
    assert "no heartbeat for" in caplog.text


def test_resume_false_on_a_directory_with_checkpoints_is_refused_unless_overwrite(tmp_path, caplog):
    fake_run(make_config(tmp_path))
    with pytest.raises(RunDirectoryError, match=r"already holds a run \(checkpoints at steps 2, 4\) and "
                                                r"checkpoint.resume=false.*--overwrite"):
        with claim(make_config(tmp_path, resume=False)):
            pass
    assert (tmp_path / "run" / "checkpoints" / "4").exists()  # nothing touched
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with claim(make_config(tmp_path, resume=False, overwrite=True)):
        pass
    left = sorted(os.listdir(tmp_path / "run"))
    assert left == ["notes.txt"]  # the run's files are gone, the user's own file is not
    assert "removing the earlier run" in caplog.text


def test_leftovers_without_a_checkpoint_start_over_with_the_same_config_only(tmp_path, caplog):
    """A run killed before its first save left its config and metrics: the same config
    starts it over (an automatic restart needs no --overwrite); another config, or a run
    with checkpoints off or resume off, is refused as before (its files could be a
    finished run's). The real kill -9 is tests/test_cli.py's."""
    fake_run(make_config(tmp_path), steps=())
    for other in (make_config(tmp_path, extra={"optim": {"learning_rate": 1e-3}}), make_config(tmp_path, resume=False),
                  make_config(tmp_path, enabled=False)):
        with pytest.raises(RunDirectoryError, match=r"\(metrics.jsonl\) and .*--overwrite"):
            with claim(other):
                pass
    with claim(make_config(tmp_path)):
        assert sorted(os.listdir(tmp_path / "run")) == [rundir.LOCK_NAME]  # the dead run's files replaced
    assert "no completed checkpoint to resume from, starting the run over" in caplog.text
    # a finished run that saved no checkpoints on purpose is not a killed one: its files stay
    fake_run(make_config(tmp_path / "off", enabled=False), steps=())
    with pytest.raises(RunDirectoryError, match=r"\(metrics.jsonl\) and .*--overwrite"):
        with claim(make_config(tmp_path / "off")):
            pass
    assert (tmp_path / "off" / "run" / "metrics.jsonl").exists()


def test_allow_changes_does_not_pass_a_change_of_the_data_position(tmp_path):
    """The checkpoint's data position counts batches of data.batch_size into the dataset of
    data.paths/seed/...: --allow-changes used to accept a batch-size change that then failed
    the resume in the data iterator with a traceback; it is refused at start, naming the key."""
    fake_run(make_config(tmp_path))
    for section, key, value in (("data", "batch_size", 4), ("data", "seed", 3), ("data", "paths", ["other.jsonl"])):
        changed = make_config(tmp_path, allow_changes=True, extra={section: {key: value}})
        with pytest.raises(RunDirectoryError, match=rf"with data\.{key}: .* not even with --allow-changes"):
            with claim(changed):
                pass
    with claim(make_config(tmp_path, allow_changes=True, extra={"optim": {"learning_rate": 1e-3}})):
        pass  # what is trained may still change when allowed


def test_resume_with_changes_names_them_and_needs_allow_changes(tmp_path, caplog):
    fake_run(make_config(tmp_path))
    changed = make_config(tmp_path, extra={"optim": {"learning_rate": 1e-3}, "train": {"log_every": 7}})
    with pytest.raises(RunDirectoryError) as err:
        with claim(changed):
            pass
    message = str(err.value)
    assert "optim.learning_rate: 1e-05 -> 0.001" in message and "--allow-changes" in message
    assert "log_every" not in message  # how a run is watched may change freely
    # a longer run moves a decaying schedule: refused too
    with pytest.raises(RunDirectoryError, match="train.total_steps: 100 -> 200"):
        with claim(make_config(tmp_path, extra={"train": {"total_steps": 200}})):
            pass
    allowed = make_config(tmp_path, allow_changes=True, extra={"optim": {"learning_rate": 1e-3}})
    with claim(allowed) as directory:
        directory.write_config()
    assert "optim.learning_rate: 1e-05 -> 0.001" in caplog.text
    # history: the first config is kept beside the new one
    first = yaml.safe_load((tmp_path / "run" / "config.1.yaml").read_text())
    now = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert first["optim"]["learning_rate"] == 1e-5 and now["optim"]["learning_rate"] == 1e-3


def test_constant_schedule_runs_may_be_extended(tmp_path):
    fake_run(make_config(tmp_path, extra={"optim": {"schedule": "constant"}}))
    with claim(make_config(tmp_path, extra={"optim": {"schedule": "constant"}, "train": {"total_steps": 500}})):
        pass


def test_resume_step_must_exist(tmp_path):
    fake_run(make_config(tmp_path))
    with pytest.raises(RunDirectoryError, match="resume_step=3: no such step .*steps there: 2, 4"):
        with claim(make_config(tmp_path, resume_step=3)):
            pass
    with claim(make_config(tmp_path, resume_step=2)):
        pass


def test_the_config_is_written_only_when_the_run_is_accepted(tmp_path):
    fake_run(make_config(tmp_path))
    before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(RunDirectoryError):
        with claim(make_config(tmp_path, extra={"optim": {"learning_rate": 1e-3}})) as directory:
            directory.write_config()
    assert (tmp_path / "run" / "config.yaml").read_text() == before
    assert not (tmp_path / "run" / "config.1.yaml").exists()
