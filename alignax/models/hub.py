"""Models named by their Hugging Face hub id: ``model.name: HuggingFaceTB/SmolLM2-135M-Instruct``.

An id resolves to a snapshot folder of the local Hugging Face cache (the layout
``huggingface_hub`` writes: ``<cache>/models--<org>--<name>/refs/<revision>`` holds a
commit hash, ``snapshots/<hash>/`` the files), so a model downloaded once by
``transformers``, ``huggingface-cli download`` or an earlier run is read where it lies.
Where nothing is cached it is downloaded, unless ``HF_HUB_OFFLINE`` is set: then one line
says that it is not cached and where it was looked for.

``org/name@revision`` picks a revision (a branch, a tag or a commit hash; ``main`` when
absent). The cache folder follows ``huggingface_hub``'s own rule, read when a name is
resolved (not when this module is imported): ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name, each part as the hub allows it (letters, digits, '-', '_', '.'), then @revision
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
# what a run reads from a model folder (alignax.models.registry.model_folder_problem):
# config and tokenizer JSON, safetensors weights, sentencepiece/BPE vocabularies, chat templates
SNAPSHOT_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")
_TRUE = {"1", "on", "yes", "true"}


class HubMiss(LookupError):
    """A hub id that is not cached and cannot be downloaded; the message says why."""


def split(name: str) -> tuple[str, str | None] | None:
    """``(repo id, revision or None)`` when ``name`` is written as a hub id, else None.
    A local folder of the same spelling wins: the caller asks only after ``os.path.isdir``."""
    m = _HUB_ID.match(name)
    return None if m is None else (m.group("repo"), m.group("revision"))


def cache_dir() -> Path:
    """The Hugging Face hub cache folder, from the environment now (see the module doc)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids downloading (read now, as the tests set it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def snapshot(repo_id: str, revision: str | None = None, *, download: bool = True) -> Path:
    """The folder of ``repo_id`` at ``revision`` in the cache, downloaded first when it is not
    there, ``download`` is true and ``HF_HUB_OFFLINE`` is not set. :class:`HubMiss` otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub_errors

    cache = cache_dir()
    local_only = offline() or not download
    shown = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=local_only,
                                      allow_patterns=list(SNAPSHOT_FILES)))
    except hub_errors.LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set, so it is not downloaded" if offline() else
               "it could not be downloaded (no connection to the hub?)" if not local_only else "")
        raise HubMiss(f"{shown} is not in the Hugging Face cache {cache}" + (f" and {why}" if why else "")) from None
    except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError, hub_errors.GatedRepoError) as err:
        raise HubMiss(f"{shown}: the hub refused it ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    except (hub_errors.HfHubHTTPError, OSError) as err:
        raise HubMiss(f"{shown} could not be downloaded into {cache} ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''})") from None


__all__ = ["SNAPSHOT_FILES", "HubMiss", "cache_dir", "offline", "snapshot", "split"]
