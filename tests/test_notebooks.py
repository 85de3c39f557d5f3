"""Every notebook in notebooks/ runs top to bottom, in a kernel on this interpreter.

The notebooks assert their own facts (gradients and advantages against the papers'
formulas, worked in loops or by hand), so a cell error here means the library changed
behaviour or a notebook went stale. They are also checked to be stored without outputs.

The kernel is started from a kernelspec written to a temporary directory whose argv is
``sys.executable``: whatever ``python3`` kernelspec the user's Jupyter paths hold, the
notebooks run against this venv's alignax, and nothing is written under the home directory
(connection file, IPython profile and history all stay in the temporary directory).
Matplotlib uses the Agg backend, so figures are drawn but never shown.

One kernel runs the module's notebooks one after another (``FRESH_START``, run before
each, empties the user namespace with ``%reset -f``, closes the figures and sets the
notebook's environment), so a notebook still sees none of another's names: a missing
import or definition fails as it would in a new kernel. What the kernel keeps is its
imports (jax, alignax, matplotlib: about 2.5 s of CPU per kernel start, 4 s with the
model notebooks' imports) and jax's compiled programs (the model notebooks score the same
tiny model). A kernel that died is replaced by a new one.

The notebooks that run a model (``MODEL_NOTEBOOKS``, on SmolLM2 for a user) run here on a
tiny random Llama: the toy model's shape (tests/support/toy_model.py) over a byte-level BPE
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
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
MODEL_NOTEBOOKS = {"token_gradients.ipynb", "aggregation_and_length.ipynb", "layer_gradients.ipynb"}
EXPECTED = {"policy_gradients.ipynb", "preference_gradients.ipynb", "advantages.ipynb",
            "overoptimisation.ipynb"} | MODEL_NOTEBOOKS
KERNEL_NAME = "python3"
PROBE = "import json, sys; print(json.dumps([sys.executable, sys.prefix]))"
# Run first in the shared kernel: the notebook starts from an empty namespace, no open
# figures, and its own environment (ALIGNAX_NOTEBOOK_MODEL for the model notebooks only).
FRESH_START = """\
import os, sys
if "matplotlib.pyplot" in sys.modules:
    sys.modules["matplotlib.pyplot"].close("all")
os.environ.pop("ALIGNAX_NOTEBOOK_MODEL", None)
os.environ.update({env!r})
get_ipython().run_line_magic("reset", "-f")
"""


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


@pytest.fixture(scope="module")
def kernel(kernel_home):
    """The module's kernel: ``{"km": manager, "kc": client}``, started by the first
    notebook's client (``kc`` None until then), shut down after the module."""
    shared = {"km": _kernel_manager(kernel_home, "notebooks"), "kc": None}
    yield shared
    if shared["kc"] is not None:
        shared["kc"].stop_channels()
        run_sync(shared["km"].shutdown_kernel)(now=True)


@pytest.mark.xdist_group("notebooks")  # one worker, one kernel for all of them
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_home: Path, kernel, request):
    nb = nbformat.read(path, as_version=4)
    assert any(cell.cell_type == "code" for cell in nb.cells), f"{path.name} has no code"
    own_env = {}
    if path.name in MODEL_NOTEBOOKS:
        own_env["ALIGNAX_NOTEBOOK_MODEL"] = request.getfixturevalue("notebook_model")
    nb.cells.insert(0, nbformat.v4.new_code_cell(FRESH_START.format(env=own_env)))
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    env = {
        **os.environ,
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "IPYTHONDIR": str(kernel_home / "ipython"),
        "JUPYTER_RUNTIME_DIR": str(kernel_home),
    }
    env.pop("ALIGNAX_NOTEBOOK_MODEL", None)
    if kernel["kc"] is not None and not run_sync(kernel["km"].is_alive)():  # a notebook killed it
        kernel["kc"].stop_channels()
        run_sync(kernel["km"].cleanup_resources)()
        kernel.update(km=_kernel_manager(kernel_home, f"notebooks-{path.stem}"), kc=None)
    client = NotebookClient(
        nb,
        km=kernel["km"],
        timeout=120,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.kc = kernel["kc"]  # None: the client starts the kernel and a client of its own
    # Raises CellExecutionError, with the failing cell's traceback, on any error. ``env``
    # and the working directory apply when this client starts the kernel.
    try:
        client.execute(cleanup_kc=False, env=env)
    finally:
        kernel["kc"] = client.kc

    outputs = nb.cells[-1].outputs
    assert [o.output_type for o in outputs] == ["stream"], outputs
    executable, prefix = json.loads(outputs[0].text)
    assert (executable, prefix) == (sys.executable, sys.prefix), "the kernel ran another interpreter"
