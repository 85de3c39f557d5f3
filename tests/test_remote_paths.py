"""A run whose output_dir is an object-store URI (``gs://``) keeps it remote: every file
goes through ``etils.epath`` to the store, nothing becomes a local ``./gs:/...`` folder.

No network: the ``gs`` scheme of etils.epath is served by a stand-in backend that keeps
the "bucket" in a local folder (``tmp/store/<bucket>/...``); the tests assert what lands
there and that the working directory stays empty.
"""

import json
import os
import shutil
import socket
import time

import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath

from alignax import paths
from alignax.config import ConfigError
from alignax.evaluation import report_path, write_report
from alignax.metrics import JsonlWriter, TensorBoardWriter, read_jsonl
from alignax.trainers.engine import rundir
from alignax.trainers.engine.rundir import RunDirectoryError, claim
from alignax.trainers.validation import validate
from tests.support.trainer_helpers import sft_conversations, tiny_config


class _LocalBucketBackend(epath_backend._OsPathBackend):  # noqa: SLF001 - the stand-in store
    """``gs://<bucket>/<key>`` served from ``<root>/<bucket>/<key>``; records every URI used."""

    def __init__(self, root: str):
        self.root = root
        self.seen: list[str] = []
        self.opened: list[str] = []  # URIs opened (read or written)

    def _local(self, path) -> str:
        uri = os.fspath(path)
        assert uri.startswith("gs://"), f"the gs backend was handed {uri!r}"
        self.seen.append(uri)
        return os.path.join(self.root, uri[len("gs://"):])

    def _uri(self, local: str) -> str:
        return "gs://" + os.path.relpath(local, self.root)

    def open(self, path, mode):
        local = self._local(path)
        self.opened.append(os.fspath(path))
        if "w" in mode or "a" in mode:
            assert "a" not in mode, "object stores cannot append"
            os.makedirs(os.path.dirname(local), exist_ok=True)  # objects need no folders
        return super().open(local, mode)

    def exists(self, path): return super().exists(self._local(path))
    def isdir(self, path): return super().isdir(self._local(path))
    def listdir(self, path): return super().listdir(self._local(path))
    def glob(self, path): return [self._uri(p) for p in super().glob(self._local(path))]
    def makedirs(self, path, **kw): return super().makedirs(self._local(path), **kw)
    def mkdir(self, path, **kw): return super().mkdir(self._local(path), **kw)
    def rmtree(self, path): return super().rmtree(self._local(path))
    def remove(self, path): return super().remove(self._local(path))
    def rename(self, path, dst): return super().rename(self._local(path), self._local(dst))
    def replace(self, path, dst): return super().replace(self._local(path), self._local(dst))
    def stat(self, path): return super().stat(self._local(path))

    def walk(self, top, **kw):  # as fsspec's: folders named without the gs:// prefix
        for root, dirs, files in super().walk(self._local(top), **kw):
            yield os.path.relpath(root, self.root), dirs, files


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The stand-in ``gs://`` store; the test runs in an empty working directory."""
    backend = _LocalBucketBackend(str(tmp_path / "store"))
    monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", backend)  # noqa: SLF001
    monkeypatch.setattr(paths, "_STAGED", {})  # another test's store held other objects
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield backend
    assert os.listdir(cwd) == [], "a remote path was written as a local folder"


def test_resolve_keeps_uris_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.resolve("gs://bucket/run") == "gs://bucket/run"
    assert paths.resolve("runs/x") == os.path.join(str(tmp_path), "runs", "x") == os.path.abspath("runs/x")
    assert str(paths.as_path("s3://b/k")) == "s3://b/k"


def _upload(local: str, uri: str) -> None:
    with paths.local_directory_for(uri) as staging:
        shutil.copytree(local, staging, dirs_exist_ok=True)


def test_a_training_run_reads_model_and_data_from_the_store_and_writes_its_directory_there(store, toy_model):
    """model.name and data.paths given as gs:// URIs are read from the store (each object
    once); claim (lock), config.yaml, metrics.jsonl and the evaluation report of a tiny
    SFT run all land in the bucket; the lock is released there."""
    from alignax.trainers.api import train

    _upload(toy_model, "gs://bucket/models/toy")
    epath.Path("gs://bucket/data/sft.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in sft_conversations(32)))
    store.opened.clear()
    config = tiny_config("gs://bucket/run", "sft", steps=2, model_dir="gs://bucket/models/toy",
                         checkpoint={"enabled": False}, train={"eval_every": 2}, evaluation={"report": True},
                         data={"paths": ["gs://bucket/data/sft.jsonl"]})
    result = train(config)
    assert result.data_stats["records"] == 32
    # each object read once (tokenizer, config, weights): the local copy serves the rest
    read = sorted(u for u in store.opened if u.startswith("gs://bucket/models/"))
    assert read == sorted(f"gs://bucket/models/toy/{name}" for name in os.listdir(toy_model)), read
    assert [u for u in store.opened if u.startswith("gs://bucket/data/")] == ["gs://bucket/data/sft.jsonl"]
    run = os.path.join(store.root, "bucket", "run")
    assert sorted(os.listdir(run)) == ["config.yaml", "evaluation", "metrics.jsonl"]
    assert any(uri.endswith(rundir.LOCK_NAME) for uri in store.seen)  # taken and released in the store
    rows = read_jsonl("gs://bucket/run/metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert sorted(os.listdir(os.path.join(run, "evaluation"))) == ["step_00000000.json", "step_00000002.json"]


def test_a_model_folder_on_the_store_loads_like_the_local_one(store, toy_model):
    """models.from_pretrained (reward, critic, PRM and judge paths) and the registry
    (model.name) read a URI through a local copy made once per process; a URI with
    nothing under it is refused naming the key."""
    import numpy as np
    from flax import nnx

    from alignax import models
    from alignax.models import registry

    _upload(toy_model, "gs://bucket/models/toy")
    remote = nnx.state(models.from_pretrained("gs://bucket/models/toy"), nnx.Param)
    local = nnx.state(models.from_pretrained(toy_model), nnx.Param)
    for a, b in zip(jax_leaves(remote), jax_leaves(local)):
        np.testing.assert_array_equal(a, b)
    copy = paths.staged("gs://bucket/models/toy")
    assert sorted(os.listdir(copy)) == sorted(os.listdir(toy_model)) and not paths.is_remote(copy)
    opened = len(store.opened)
    assert str(registry.model_directory("gs://bucket/models/toy/", key="model.name")) == copy
    assert len(store.opened) == opened  # staged once per process
    with pytest.raises(registry.ModelNotFoundError, match="model.name=gs://bucket/nothing: nothing there"):
        registry.model_directory("gs://bucket/nothing", key="model.name")
    with pytest.raises(FileNotFoundError, match="data.paths=gs://bucket/none.jsonl: nothing there"):
        paths.staged("gs://bucket/none.jsonl", key="data.paths")


def test_data_errors_name_the_uri_not_the_local_copy(store, toy_model):
    """A bad record in a file or folder staged from the store is reported at its URI (the
    local copy under the staging directory would be no help to whoever fixes the data)."""
    from alignax.data import BadRecordError, DataConfig, prepare_dataset
    from alignax.models.registry import load_tokenizer

    lines = [json.dumps(r) for r in sft_conversations(4)]
    lines[2] = '{"messages": [}'
    text = "".join(line + "\n" for line in lines)
    epath.Path("gs://bucket/data/sft.jsonl").write_text(text)
    epath.Path("gs://bucket/repo/train/part-0.jsonl").write_text(text)
    tokenizer = load_tokenizer(toy_model)
    for uri, where in (("gs://bucket/data/sft.jsonl", "gs://bucket/data/sft.jsonl, line 3"),
                       ("gs://bucket/repo/", "gs://bucket/repo/train/part-0.jsonl, line 3")):
        with pytest.raises(BadRecordError, match="malformed JSON") as err:
            prepare_dataset(DataConfig(format="sft", paths=[uri], max_length=32, max_prompt_length=16), tokenizer)
        assert str(err.value).startswith(f"{where}:"), str(err.value)
        assert paths.staged(uri) not in str(err.value)
    with pytest.raises(ValueError, match="^gs://bucket/repo holds no .* data files for split 'test'"):
        prepare_dataset(DataConfig(format="sft", paths=["gs://bucket/repo"], split="test", max_length=32,
                                   max_prompt_length=16), tokenizer)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_metrics_are_rewritten_not_appended_and_reports_are_one_upload(store):
    writer = JsonlWriter("gs://bucket/run/metrics.jsonl")
    writer.write(1, {"loss": 1.0})
    writer.close()
    again = JsonlWriter("gs://bucket/run/metrics.jsonl")  # a resumed run keeps what was there
    again.write(2, {"loss": float("nan")})
    again.close()
    rows = read_jsonl("gs://bucket/run/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == 1.0
    path = write_report(report_path("gs://bucket/run", 3), {"acc": 0.5}, step=3)
    assert path == "gs://bucket/run/evaluation/step_00000003.json"
    stored = os.path.join(store.root, "bucket", "run", "evaluation")
    assert os.listdir(stored) == ["step_00000003.json"]  # no temporary left beside it
    assert json.loads(open(os.path.join(stored, "step_00000003.json")).read())["figures"] == {"acc": 0.5}


def test_a_held_remote_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(store, caplog):
    config = tiny_config("gs://bucket/run", "sft")
    lock = epath.Path("gs://bucket/run") / rundir.LOCK_NAME
    lock.write_text(json.dumps({"host": "another-host", "pid": 1, "started": "earlier"}))
    with pytest.raises(RunDirectoryError, match="in use by another run .host another-host"):
        with claim(config):
            pass
    stale = time.time() - rundir.STALE_AFTER_S - 60
    os.utime(os.path.join(store.root, "bucket", "run", rundir.LOCK_NAME), (stale, stale))
    with claim(config) as directory:
        assert json.loads(lock.read_text())["host"] == socket.gethostname()
        directory.write_config()
    assert not lock.exists()
    assert "no exclusive create" in caplog.text and "taking over the stale lock" in caplog.text


def test_the_checkpointer_hands_orbax_the_uri(store, monkeypatch):
    from alignax import checkpoint

    handed = []

    class Recorder:
        def __init__(self, directory, **kw):
            handed.append(directory)

    monkeypatch.setattr(checkpoint.ocp, "CheckpointManager", Recorder)
    ckpt = checkpoint.Checkpointer("gs://bucket/run/checkpoints")
    assert ckpt.directory == "gs://bucket/run/checkpoints"
    assert isinstance(handed[0], epath.Path) and str(handed[0]) == "gs://bucket/run/checkpoints"
    os.makedirs(os.path.join(store.root, "bucket", "run", "checkpoints", "7"))
    assert rundir.checkpoint_steps("gs://bucket/run") == [7]


def test_checkpoint_digests_are_written_and_checked_in_the_store(store):
    from alignax.checkpoint import DIGEST_FILE, check_digest, write_digest

    step = os.path.join(store.root, "bucket", "run", "checkpoints", "3")
    os.makedirs(os.path.join(step, "state"))
    for name, text in (("state/array", "0123"), ("meta.json", "{}")):
        with open(os.path.join(step, name), "w") as f:
            f.write(text)
    uri = "gs://bucket/run/checkpoints/3"
    assert write_digest(uri) == f"{uri}/{DIGEST_FILE}"
    manifest = json.loads(open(os.path.join(step, DIGEST_FILE)).read())
    assert sorted(manifest["files"]) == ["meta.json", "state/array"]
    assert check_digest(uri, base="gs://bucket/run/checkpoints") is None
    with open(os.path.join(step, "state", "array"), "w") as f:
        f.write("0124")
    assert check_digest(uri, base="gs://bucket/run/checkpoints") == (
        "3/state/array: SHA-256 does not match the digest written at save time")


def test_an_export_for_the_store_is_written_locally_then_copied_up(store):
    with paths.local_directory_for("gs://bucket/run/export") as local:
        assert not paths.is_remote(local) and os.path.isdir(local)
        os.makedirs(os.path.join(local, "critic"))
        with open(os.path.join(local, "critic", "config.json"), "w") as f:
            f.write("{}")
    assert epath.Path("gs://bucket/run/export/critic/config.json").read_text() == "{}"
    assert not os.path.exists(local)


def test_what_cannot_run_on_a_store_is_refused_naming_the_key(store):
    with pytest.raises(ValueError, match="logging.tensorboard: TensorBoard cannot write to az://"):
        TensorBoardWriter("az://container/run/tensorboard")
    with pytest.raises(ConfigError, match="output_dir=gs://bucket/run: iterative_dpo writes each round"):
        validate(tiny_config("gs://bucket/run", "iterative-dpo"))


def test_atomic_open_writes_whole_or_not_at_all(tmp_path):
    """A file written through ``paths.atomic_open`` (the sampler weights a checkpoint names,
    safetensors, a run's text files) appears whole when the block ends; an error in the block
    leaves the old file as it was and no temporary beside it."""
    target = tmp_path / "weights.npz"
    with paths.atomic_open(target) as f:
        f.write(b"old")
        assert not target.exists()  # nothing at the path until the block ends
    with pytest.raises(RuntimeError, match="killed mid-write"):
        with paths.atomic_open(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["weights.npz"]
    paths.write_text(tmp_path / "note.txt", "whole")
    assert (tmp_path / "note.txt").read_text() == "whole"
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"):
        with paths.atomic_open(target, "a"):
            pass


def test_an_async_run_keeps_its_in_flight_weights_on_the_store(store):
    """``rollout.async`` with ``output_dir`` on a bucket: the weights of a rollout in flight that
    a checkpoint names go to ``<output_dir>/async_in_flight`` on the store (one upload), read back
    bit for bit, and go with the checkpoints that no longer need them, a half-written
    temporary of this process included (it used to be ``pathlib.Path("gs://b/run")``: a local
    folder ``gs:`` in the working directory, which the fixture refuses)."""
    import jax.numpy as jnp
    import ml_dtypes

    from alignax.trainers.online.schedule import AsyncSchedule, read_weights, write_weights

    weights = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(4, ml_dtypes.bfloat16)}
    directory = paths.as_path("gs://bucket/run/async_in_flight")
    write_weights(directory / "step_3.version_1.process_0.npz", weights)
    back = read_weights(directory / "step_3.version_1.process_0.npz", weights)
    for key in weights:
        assert back[key].dtype == weights[key].dtype
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(weights[key]))
    (directory / "step_2.version_0.process_0.npz.tmp-77-88").write_bytes(b"half")  # a killed write's remains
    (directory / "step_2.version_0.process_1.npz").write_bytes(b"another process's")
    schedule = AsyncSchedule.__new__(AsyncSchedule)  # only its directory bookkeeping
    schedule.directory, schedule.kept_steps = directory, lambda: [3]
    schedule.clean()
    assert sorted(p.name for p in directory.iterdir()) == ["step_2.version_0.process_1.npz",
                                                           "step_3.version_1.process_0.npz"]
