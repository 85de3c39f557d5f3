"""A script under tools/ imported as a module, as a test calls its functions (tools/ is no
package: its scripts run as files)."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(relative_path: str, name: str | None = None):
    """The module of ``tools/<relative_path>`` (e.g. ``"mutation/summary.py"``), executed once
    per call under ``name`` (default: the file's stem)."""
    path = os.path.join(ROOT, "tools", relative_path)
    spec = importlib.util.spec_from_file_location(name or os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
