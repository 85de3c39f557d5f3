"""Checkpoint integrity: digest manifests, fallback to the newest intact step, and the
keep-N rotation after a fallback (alignax.checkpoint)."""

import glob
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from alignax.checkpoint import DIGEST_FILE, Checkpointer, CorruptCheckpointError


def make_state(step: int):
    # Random values: incompressible, so the array's bytes are the biggest data file.
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.standard_normal(4096, dtype=np.float32)),
            "head": {"b": jnp.full((3, 3), float(step)), "n": jnp.asarray(step, jnp.int32)}}


def assert_state_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    np.testing.assert_array_equal(np.asarray(got["head"]["b"]), np.asarray(want["head"]["b"]))
    assert int(got["head"]["n"]) == int(want["head"]["n"])


def saved_run(directory, steps=(1, 2, 3), *, keep=3, async_save=True):
    ckpt = Checkpointer(str(directory), keep=keep, async_save=async_save)
    for step in steps:
        ckpt.save(step, make_state(step), {"step": step, "data": {"epoch": step}})
    ckpt.close()
    return str(directory)


def data_file(directory, step) -> str:
    """The biggest array-data chunk Orbax wrote (OCDBT) for ``step``."""
    files = glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)
    return max(files, key=os.path.getsize)


def flip_bytes(path):
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    for i in range(len(raw) // 2, len(raw) // 2 + 8):
        raw[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)


def drop_digest(directory, step):
    os.remove(os.path.join(directory, str(step), DIGEST_FILE))


def restore_after_damage(directory, caplog, *, with_digest):
    """Restore ``directory`` whose step 3 was damaged (digest dropped unless ``with_digest``):
    step 2 comes back; returns the warnings logged."""
    if not with_digest:  # e.g. written by an older version: the failing restore is the check
        drop_digest(directory, 3)
    with caplog.at_level(logging.WARNING, logger="alignax"), Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(make_state(0))
    assert meta["step"] == 2
    assert_state_equal(state, make_state(2))
    return warnings_text(caplog)


def warnings_text(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("async_save", [True, False])
def test_flipped_bytes_fall_back_to_previous_step(tmp_path, caplog, async_save):
    directory = saved_run(tmp_path / "ckpt", async_save=async_save)
    bad = data_file(directory, 3)
    flip_bytes(bad)
    with caplog.at_level(logging.WARNING, logger="alignax"), Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(make_state(0))
        assert ckpt.restored_step == 2 and meta["step"] == 2 and meta["data"] == {"epoch": 2}
        assert_state_equal(state, make_state(2))
        assert ckpt.all_steps() == [1, 2]  # the corrupt newer step is gone
    text = warnings_text(caplog)
    assert "step 3" in text and os.path.relpath(bad, directory) in text


@pytest.mark.parametrize("with_digest", [
    True,
    # Orbax abandons the other shards' read coroutines when one fails (garbage-collected later).
    pytest.param(False, marks=pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")),
])
def test_truncated_array_falls_back(tmp_path, caplog, with_digest):
    directory = saved_run(tmp_path / "ckpt", async_save=False)
    bad = data_file(directory, 3)
    truncate(bad)
    text = restore_after_damage(directory, caplog, with_digest=with_digest)
    assert "step 3" in text
    assert (os.path.relpath(bad, directory) if with_digest else "item 'state' (3/state)") in text


@pytest.mark.parametrize("with_digest", [True, False])
def test_garbled_meta_falls_back_naming_the_file(tmp_path, caplog, with_digest):
    directory = saved_run(tmp_path / "ckpt", async_save=False)
    meta_file = os.path.join(directory, "3", "meta", "metadata")
    assert os.path.isfile(meta_file)
    with open(meta_file, "w") as f:
        f.write('{"step": 3, "data": {tru')
    text = restore_after_damage(directory, caplog, with_digest=with_digest)
    assert "step 3" in text and os.path.join("3", "meta", "metadata") in text
    if not with_digest:
        assert "JSONDecodeError" in text


def test_explicit_corrupt_step_raises_without_fallback(tmp_path):
    directory = saved_run(tmp_path / "ckpt", async_save=False)
    bad = data_file(directory, 3)
    flip_bytes(bad)
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="step 3") as err:
            ckpt.restore(make_state(0), step=3)
        assert os.path.relpath(bad, directory) in str(err.value)
        assert ckpt.all_steps() == [1, 2, 3]  # nothing deleted on an explicit request
        assert ckpt.verify(3) is not None and os.path.relpath(bad, directory) in ckpt.verify(3)
        assert ckpt.verify(2) is None
        state, meta = ckpt.restore(make_state(0), step=2)
        assert ckpt.restored_step == 2 and meta["step"] == 2
        assert_state_equal(state, make_state(2))


def test_all_steps_corrupt_raises_listing_them(tmp_path):
    directory = saved_run(tmp_path / "ckpt", async_save=False)
    flip_bytes(data_file(directory, 3))
    truncate(data_file(directory, 2))
    drop_digest(directory, 1)
    with open(os.path.join(directory, "1", "meta", "metadata"), "w") as f:
        f.write("not json")
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CorruptCheckpointError) as err:
            ckpt.restore(make_state(0))
        assert ckpt.all_steps() == [1, 2, 3]  # no intact step: nothing is deleted
    message = str(err.value)
    assert all(f"step {s}:" in message for s in (1, 2, 3))
    assert "SHA-256" in message and "size" in message and "JSONDecodeError" in message


@pytest.mark.parametrize("async_save", [True, False])
def test_digest_written_once_committed_and_rotated_with_its_step(tmp_path, async_save):
    directory = str(tmp_path / "ckpt")
    ckpt = Checkpointer(directory, keep=2, async_save=async_save)
    ckpt.save(1, make_state(1), {"step": 1})
    ckpt.save(2, make_state(2), {"step": 2})
    assert os.path.isfile(os.path.join(directory, "1", DIGEST_FILE))  # written at the next save
    ckpt.save(3, make_state(3), {"step": 3})
    ckpt.wait()
    assert os.path.isfile(os.path.join(directory, "3", DIGEST_FILE))  # written at wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    assert not os.path.exists(os.path.join(directory, "1"))  # rotated away, digest and all
    assert ckpt.verify(2) is None and ckpt.verify(3) is None
    ckpt.save(4, make_state(4), {"step": 4})
    ckpt.close()
    assert os.path.isfile(os.path.join(directory, "4", DIGEST_FILE))  # written at close()
    assert sorted(os.listdir(directory)) == ["3", "4"]
    with Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [3, 4]
        state, meta = ckpt.restore(make_state(0))
    assert meta["step"] == 4
    assert_state_equal(state, make_state(4))


def test_step_without_digest_still_restores(tmp_path):
    directory = saved_run(tmp_path / "ckpt", async_save=False)
    for step in (1, 2, 3):
        drop_digest(directory, step)  # raises if the digest had not been written
    with Checkpointer(directory) as ckpt:
        assert ckpt.verify(3) is None
        state, meta = ckpt.restore(make_state(0))
    assert meta["step"] == 3
    assert_state_equal(state, make_state(3))


def test_save_after_fallback_continues_after_the_intact_step(tmp_path):
    directory = saved_run(tmp_path / "ckpt", keep=2, async_save=True)  # steps 2 and 3 kept
    flip_bytes(data_file(directory, 3))
    with Checkpointer(directory, keep=2) as ckpt:
        _, meta = ckpt.restore(make_state(0))
        assert meta["step"] == 2
        assert ckpt.save(3, make_state(30), {"step": 3})  # refused if corrupt step 3 remained
        ckpt.wait()
        assert ckpt.latest_step() == 3 and ckpt.all_steps() == [2, 3]
        ckpt.save(4, make_state(4), {"step": 4})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
        state, meta = ckpt.restore(make_state(0), step=3)
    assert meta["step"] == 3
    assert_state_equal(state, make_state(30))


def test_corrupt_reference_raises_naming_the_file(tmp_path):
    directory = str(tmp_path / "ckpt")
    reference = {"w": make_state(5)["w"]}
    with Checkpointer(directory) as ckpt:
        ckpt.save_reference(reference)
        assert os.path.isfile(os.path.join(ckpt.reference_path, DIGEST_FILE))
        restored = ckpt.restore_reference(reference)
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(reference["w"]))
        files = glob.glob(os.path.join(ckpt.reference_path, "**", "d", "*"), recursive=True)
        bad = max(files, key=os.path.getsize)
        flip_bytes(bad)
        with pytest.raises(CorruptCheckpointError, match="reference") as err:
            ckpt.restore_reference(reference)
    assert os.path.relpath(bad, directory) in str(err.value)


def test_check_for_errors_is_quiet_after_a_good_save(tmp_path):
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, make_state(1), {"step": 1})
        ckpt.check_for_errors()  # the train loop calls it after every save


def test_another_model_shape_is_refused_naming_the_parameter(tmp_path):
    from alignax.checkpoint import CheckpointMismatchError

    directory = saved_run(tmp_path / "ckpt", steps=(1, 2))
    wider = make_state(0)
    wider["head"]["b"] = jnp.zeros((3, 4))
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointMismatchError, match=r"head/b has shape \(3, 3\) in the checkpoint and "
                                                          r"\(3, 4\) in the model"):
            ckpt.restore(wider)
        missing = make_state(0)
        missing["extra"] = jnp.zeros(2)
        with pytest.raises(CheckpointMismatchError, match="extra is in the model but not in the checkpoint"):
            ckpt.restore(missing)
        assert ckpt.all_steps() == [1, 2]  # a mismatch is not corruption: nothing deleted


def test_delete_after_removes_newer_steps(tmp_path):
    directory = saved_run(tmp_path / "ckpt", steps=(1, 2, 3))
    with Checkpointer(directory) as ckpt:
        assert ckpt.delete_after(1) == [2, 3]
        assert ckpt.all_steps() == [1]
        state, meta = ckpt.restore(make_state(0))
    assert meta["step"] == 1
    assert_state_equal(state, make_state(1))
