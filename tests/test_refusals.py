"""Every refusal of user input ends ``alignax`` in one line and exit status 2.

The sweep runs ``alignax.cli.main`` in this process on tiny recipes, each broken in one
way that used to end in a traceback and exit 1 (or in nothing at all), and checks the
one line: it starts with ``alignax:``, names the key, file or flag to change, and no
traceback is printed unless ``--debug`` or ``ALIGNAX_DEBUG=1`` asks for it. Once, the
same refusal goes through ``python -m alignax.cli`` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
import yaml

from alignax.data import write_jsonl
from tests.support.trainer_helpers import separable_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def files(tmp_path_factory, toy_model):
    """Recipes and broken inputs under one folder: ``{name: path}``."""
    base = tmp_path_factory.mktemp("refusals")
    write_jsonl(separable_pairs(40), base / "pairs.jsonl")
    (base / "bad.parquet").write_bytes(b"PAR1" + bytes(range(200)))  # Parquet's magic, then no footer
    (base / "empty-model").mkdir()
    damaged = {}  # one file of the toy model folder damaged each
    for name, file, damage in (("broken-model", "config.json", lambda b: b'{"model_type": "llama", "vocab'),  # cut mid-string
                               ("bad-tokenizer", "tokenizer.json", lambda b: b[:13]),
                               ("bad-weights", "model.safetensors", lambda b: b[:100]),
                               ("bad-architecture", "config.json",
                                lambda b: b.replace(b'"model_type": "llama"', b'"model_type": "mamba"'))):
        folder = base / name
        folder.mkdir()
        for other in os.listdir(toy_model):
            data = open(os.path.join(toy_model, other), "rb").read()
            (folder / other).write_bytes(damage(data) if other == file else data)
        damaged[name] = str(folder)
    assert b'"model_type": "mamba"' in (base / "bad-architecture" / "config.json").read_bytes()
    common = {"model": {"name": toy_model}, "train": {"total_steps": 1},
              "logging": {"console": False, "tensorboard": False}, "mesh": {"shape": [1, 1, 1]}}
    dpo = {"algorithm": "dpo", "output_dir": str(base / "run"), **common,
           "data": {"paths": [str(base / "pairs.jsonl")], "format": "preference", "batch_size": 8,
                    "max_length": 32, "max_prompt_length": 24, "eval_fraction": 0.0}}
    grpo = {"algorithm": "grpo", "output_dir": str(base / "grun"), **common,
            "data": {"paths": ["reasoning_gym:chain_sum?size=16&seed=0"], "format": "prompt", "batch_size": 2,
                     "max_prompt_length": 24},
            "rollout": {"max_new_tokens": 4, "num_samples": 2}}
    (base / "dpo.yaml").write_text(yaml.safe_dump(dpo))
    (base / "grpo.yaml").write_text(yaml.safe_dump(grpo))
    (base / "syntax.yaml").write_text("algorithm: dpo\nmodel: {name: x\n  bad: [\n")
    return {**{name: str(base / name) for name in ("dpo.yaml", "grpo.yaml", "syntax.yaml", "bad.parquet",
                                                   "empty-model")}, **damaged}


# name: (arguments with {file} placeholders, what the one line must say)
REFUSALS = {
    "yaml syntax": (["train", "{syntax.yaml}"], "{syntax.yaml}, line 3, column 6: not valid YAML"),
    "mesh larger than the devices": (["train", "{dpo.yaml}", "mesh.shape=[2,1,1]"],
                                     "mesh shape (2, 1, 1) needs 2 devices; 1 are available"),
    "corrupt parquet": (["train", "{dpo.yaml}", "data.paths=[{bad.parquet}]"],
                        "{bad.parquet}: not a readable Parquet file"),
    "model folder without files": (["train", "{dpo.yaml}", "model.name={empty-model}"],
                                   "model.name={empty-model}: the model folder lacks config.json"),
    "hub id not cached, offline": (["train", "{dpo.yaml}", "model.name=nobody-org/no-model"],
                                   "model.name 'nobody-org/no-model' is neither a registry model, a local Hugging Face "
                                   "folder nor available from the hub: nobody-org/no-model is not in the Hugging Face "
                                   "cache"),
    "corrupt config.json": (["train", "{dpo.yaml}", "model.name={broken-model}"],
                            "model.name={broken-model}: {broken-model}/config.json is not valid JSON"),
    "truncated tokenizer.json": (["train", "{dpo.yaml}", "model.name={bad-tokenizer}"],
                                 "model.name={bad-tokenizer}: the tokenizer in {bad-tokenizer} cannot be read"),
    "truncated weights": (["train", "{dpo.yaml}", "model.name={bad-weights}"],
                          "{bad-weights}/model.safetensors: header length"),
    "unsupported architecture": (["train", "{dpo.yaml}", "model.name={bad-architecture}"],
                                 "model.name={bad-architecture}: the model (config.json and weights) in "
                                 "{bad-architecture} cannot be read: ValueError: unsupported architecture "
                                 "model_type='mamba'"),
    "data file of another kind": (["train", "{dpo.yaml}", "data.paths=[{syntax.yaml}]"],
                                  "unsupported data file '{syntax.yaml}'; expected one of .jsonl"),
    "sub-mesh larger than the devices": (
        ["train", "{grpo.yaml}", "placement.reference=submesh", "placement.submesh=[1,2,1]"],
        "placement.submesh=[1, 2, 1] sets 2 devices apart"),
    "rollout mesh larger than the devices": (["train", "{grpo.yaml}", "rollout.mesh=[1,1,2]"],
                                             "rollout.mesh=[1, 1, 2]: the sampler's mesh"),
    "estimate --mesh not numbers": (["estimate", "{dpo.yaml}", "--mesh", "a,b"],
                                    "--mesh 'a,b': expected three sizes data,fsdp,tensor"),
    "estimate --device-memory negative": (["estimate", "{dpo.yaml}", "--device-memory", "-5"],
                                          "--device-memory -5: expected a positive number of GB"),
    "estimate --devices zero": (["estimate", "{dpo.yaml}", "--devices", "0"],
                                "--devices 0: expected a positive number of devices"),
    "estimate --mfu above one": (["estimate", "{dpo.yaml}", "--mfu", "40"], "--mfu 40: expected a fraction in (0, 1]"),
}


def fill(text: str, files: dict) -> str:
    for name, path in files.items():
        text = text.replace("{" + name + "}", path)
    return text


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refusal_is_one_line_and_exit_2(case, files, capfd, monkeypatch):
    from alignax import cli

    monkeypatch.delenv("ALIGNAX_DEBUG", raising=False)
    args, expected = REFUSALS[case]
    code = cli.main([fill(a, files) for a in args])
    out, err = capfd.readouterr()
    problems = [line for line in err.splitlines() if not line.startswith(("INFO ", "WARNING "))]
    assert code == 2, err[-3000:]
    assert len(problems) == 1 and "Traceback" not in err, err[-3000:]
    assert problems[0].startswith("alignax: ") and fill(expected, files) in problems[0], problems[0]
    assert problems[0].endswith("(--debug shows the traceback)")


def test_debug_and_alignax_debug_show_the_traceback(files, capfd, monkeypatch):
    from alignax import cli

    args = ["train", files["dpo.yaml"], "mesh.shape=[2,1,1]"]
    assert cli.main([*args, "--debug"]) == 2
    assert "Traceback" in capfd.readouterr().err
    monkeypatch.setenv("ALIGNAX_DEBUG", "1")
    assert cli.main(args) == 2
    assert "Traceback" in capfd.readouterr().err


def test_the_entrypoint_prints_the_one_line(files):
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env.pop("ALIGNAX_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "alignax.cli", "train", files["syntax.yaml"]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"alignax: config error: {files['syntax.yaml']}, line 3, column 6: not valid YAML (expected ',' or '}}', "
        "but got ':') (--debug shows the traceback)"]


def test_estimate_with_an_open_mesh_axis_assumes_the_devices_and_says_so(files, capfd):
    """A recipe whose mesh has a -1 axis (configs/dpo.yaml's default) is estimated on one
    host of --device's kind, or on this machine's devices, and the line says which."""
    from alignax import cli

    recipe = os.path.join(ROOT, "configs", "dpo.yaml")
    assert cli.main(["estimate", recipe, "--device", "h100", "--json"]) == 0
    out, err = capfd.readouterr()
    assert "assuming the 8 devices of one h100 host (--devices N to choose)" in err
    assert (json.loads(out)["devices"], json.loads(out)["mesh"]) == (8, [1, 8, 1])
    assert cli.main(["estimate", recipe, "--json"]) == 0
    out, err = capfd.readouterr()
    here = jax.device_count()
    assert f"assuming the {here} devices of this machine" in err and json.loads(out)["mesh"] == [1, here, 1]
