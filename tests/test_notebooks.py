"""Every notebook in notebooks/ runs top to bottom, in a kernel on this interpreter.

The notebooks assert their own facts (gradients and advantages against the papers'
formulas, worked in loops or by hand), so a cell error here means the library changed
behaviour or a notebook went stale. They are also checked to be stored without outputs.

The kernel is started from a kernelspec written to a temporary directory whose argv is
``sys.executable``: whatever ``python3`` kernelspec the user's Jupyter paths hold, the
notebooks run against this venv's alignax, and nothing is written under the home directory
(connection file, IPython profile and history all stay in the temporary directory).
Matplotlib uses the Agg backend, so figures are drawn but never shown.

The notebooks that run a model (``MODEL_NOTEBOOKS``, on SmolLM2 for a user) run here on a
tiny random Llama: the toy model's shape (tests/toy_model.py) over a byte-level BPE
tokenizer with SmolLM2's chat template, so reasoning-gym text tokenises, written to a
temporary folder and named by ``ALIGNAX_NOTEBOOK_MODEL``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
MODEL_NOTEBOOKS = {"token_gradients.ipynb", "aggregation_and_length.ipynb", "layer_gradients.ipynb"}
EXPECTED = {"policy_gradients.ipynb", "preference_gradients.ipynb", "advantages.ipynb",
            "overoptimisation.ipynb"} | MODEL_NOTEBOOKS
KERNEL_NAME = "python3"
PROBE = "import json, sys; print(json.dumps([sys.executable, sys.prefix]))"


def test_the_notebooks_are_there():
    assert EXPECTED <= {path.name for path in NOTEBOOKS}, f"missing from {NOTEBOOKS_DIR}: {EXPECTED}"


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory) -> Path:
    """A temporary Jupyter data directory with one kernelspec: this interpreter's ipykernel."""
    home = tmp_path_factory.mktemp("jupyter")
    spec_dir = home / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.prefix})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    (home / "ipython").mkdir()
    return home


@pytest.fixture(scope="module")
def notebook_model(toy_model, tmp_path_factory) -> str:
    """The tiny model folder the model notebooks run on (see the module docstring)."""
    from alignax.models import ModelConfig, create_model, save_pretrained
    from tests.data.tiny_tokenizer import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    config = json.loads((Path(toy_model) / "config.json").read_text())
    config.update(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"))
    directory = tmp_path_factory.mktemp("notebook-model")
    save_pretrained(create_model(ModelConfig.from_hf_config(config)), directory)
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def _kernel_manager(home: Path, name: str) -> AsyncKernelManager:
    specs = KernelSpecManager(kernel_dirs=[str(home / "kernels")])
    assert specs.get_kernel_spec(KERNEL_NAME).argv[0] == sys.executable
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
    km.connection_file = str(home / f"kernel-{name}.json")
    return km


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {index} has stored outputs; clear them before committing"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_home: Path, request):
    nb = nbformat.read(path, as_version=4)
    assert any(cell.cell_type == "code" for cell in nb.cells), f"{path.name} has no code"
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    env = {
        **os.environ,
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "IPYTHONDIR": str(kernel_home / "ipython"),
        "JUPYTER_RUNTIME_DIR": str(kernel_home),
    }
    if path.name in MODEL_NOTEBOOKS:
        env["ALIGNAX_NOTEBOOK_MODEL"] = request.getfixturevalue("notebook_model")
    client = NotebookClient(
        nb,
        km=_kernel_manager(kernel_home, path.stem),
        timeout=120,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    # Raises CellExecutionError, with the failing cell's traceback, on any error.
    client.execute(cleanup_kc=True, env=env)

    outputs = nb.cells[-1].outputs
    assert [o.output_type for o in outputs] == ["stream"], outputs
    executable, prefix = json.loads(outputs[0].text)
    assert (executable, prefix) == (sys.executable, sys.prefix), "the kernel ran another interpreter"
