"""Package layout: no import cycles between alignax modules.

The import graph is built statically with ``ast`` (nothing of the package is executed).
A module is a ``.py`` file under ``alignax/``; a package's ``__init__.py`` is the module
named after its folder. Edges:

- ``import a.b.c`` and ``from a.b.c import name``: to ``a.b.c``, or, when that is not one
  of our modules, to the longest prefix that is (``from pkg.mod import func`` -> pkg.mod);
- ``from a.b import c`` where ``a.b.c`` is a module: to ``a.b.c`` as well;
- relative imports (``from . import x``, ``from ..y import z``) resolved from the file's
  package;
- importing ``a.b.c`` first runs ``a/__init__.py`` and ``a/b/__init__.py``: an edge to a
  module implies edges to its parent packages' ``__init__``;
- imports inside functions count (a lazy import hides a cycle, it does not remove it);
  imports under ``if TYPE_CHECKING:`` do not (they never run).

The implied edges from a module to its *own* parent packages are left out: Python has
initialised (or is initialising) those before the module's first line, so they cannot
close a cycle. An explicit ``from <own package> import NAME`` where NAME is not a
submodule is kept: it reads a name the package's ``__init__`` defines, and fails if that
``__init__`` is what (indirectly) imported the module.
"""

from __future__ import annotations

import ast
import os
import textwrap
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# --- the graph --------------------------------------------------------------------------


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file under ``root/package``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules it imports}`` among the modules of ``package`` under ``root``."""
    modules = package_modules(root, package)

    def longest_module(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own_package = module if is_package else module.rpartition(".")[0]
        own_ancestors = set(_ancestors(module))
        explicit: set[str] = set()  # modules named by an import statement
        ancestor_names: set[str] = set()  # own packages a non-module name is taken from
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = longest_module(alias.name)
                    if target:
                        explicit.add(target)
                continue
            if node.level:
                base = own_package.split(".") if own_package else []
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            target = longest_module(source)
            if target is None:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if alias.name != "*" and submodule in modules:
                    explicit.add(submodule)
                elif target == source and target in own_ancestors:
                    ancestor_names.add(target)  # a name defined by our own package's __init__
                else:
                    explicit.add(target)
        edges = set()
        for target in explicit:
            edges.add(target)
            edges.update(a for a in _ancestors(target) if a in modules)
        edges -= own_ancestors  # already initialised before this module runs
        edges |= ancestor_names
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import cycle: every strongly connected component of more than
    one module (Tarjan, iterative), each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import chain from the component's first module back to itself."""
    first = min(component)
    members = set(component)
    previous: dict[str, str] = {}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & members):
            if child == first:
                path = [node]
                while path[-1] != first:
                    path.append(previous[path[-1]])
                return [*reversed(path), first]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle in component {sorted(component)}")


def describe(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    """One line per cycle: its modules, then one chain of imports that closes it."""
    return "\n".join(f"  {' <-> '.join(c)}   (e.g. {' -> '.join(cycle_path(graph, c))})" for c in cycles)


# --- the package ------------------------------------------------------------------------


def test_alignax_has_no_import_cycles():
    graph = import_graph(ROOT, "alignax")
    assert "alignax.config" in graph and "alignax.losses" in graph  # the walk found the package
    cycles = find_cycles(graph)
    assert not cycles, f"import cycles between alignax modules (break each one):\n{describe(graph, cycles)}"


# --- the graph and cycle finder on fake packages -----------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_graph_resolves_every_import_form(tmp_path):
    root = write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.core import run\n",
        "pkg/core.py": """
            import os
            import pkg.util
            from . import helpers
            from .sub import deep
            from pkg.sub.deep import thing as other
            def lazy():
                from pkg.extra import x
            """,
        "pkg/util.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.core import run\n",
        "pkg/helpers.py": "",
        "pkg/extra.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "from ..helpers import h\nfrom .. import util\nimport numpy\n",
    })
    graph = import_graph(root, "pkg")
    assert set(graph) == {"pkg", "pkg.core", "pkg.util", "pkg.helpers", "pkg.extra", "pkg.sub", "pkg.sub.deep"}
    assert graph["pkg"] == {"pkg.core"}
    # own package 'pkg' left out; pkg.sub implied by pkg.sub.deep; the lazy import counts
    assert graph["pkg.core"] == {"pkg.util", "pkg.helpers", "pkg.sub", "pkg.sub.deep", "pkg.extra"}
    assert graph["pkg.util"] == set()  # TYPE_CHECKING only
    assert graph["pkg.sub.deep"] == {"pkg.helpers", "pkg.util"}
    assert find_cycles(graph) == []


def test_finds_a_direct_cycle(tmp_path):
    root = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\ndef f(): return g()\n",
        "pkg/b.py": "from . import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "import pkg.a\n",
    })
    graph = import_graph(root, "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert cycle_path(graph, ["pkg.a", "pkg.b", "pkg.c"]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def test_a_lazy_import_still_closes_a_cycle(tmp_path):
    root = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/online.py": "from pkg.grpo import GRPO\n",
        "pkg/grpo.py": "class GRPO:\n    def run(self):\n        from pkg.online import loop\n",
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.grpo", "pkg.online"]]


def test_a_cycle_through_a_parent_package_init(tmp_path):
    # pkg/rewards.py imports pkg.trainers.rollout, which first runs pkg/trainers/__init__.py,
    # which imports pkg.rewards: a cycle although no module names the other directly.
    root = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/rewards.py": "from pkg.trainers.rollout import load\n",
        "pkg/trainers/__init__.py": "from pkg.rewards import score\n",
        "pkg/trainers/rollout.py": "",
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.rewards", "pkg.trainers"]]


def test_own_package_init_counts_only_for_names_it_defines(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.losses import loss\nVERSION = 1\n",
        "pkg/losses.py": "from pkg import helpers\nfrom . import helpers as h2\nimport pkg\n",
        "pkg/helpers.py": "",
    }
    assert find_cycles(import_graph(write_package(tmp_path / "ok", files), "pkg")) == []
    # reading a name pkg/__init__.py defines, while pkg/__init__.py imports us: a real cycle
    files["pkg/losses.py"] += "from pkg import VERSION\n"
    graph = import_graph(write_package(tmp_path / "bad", files), "pkg")
    assert find_cycles(graph) == [["pkg", "pkg.losses"]]


def test_two_cycles_are_both_reported(tmp_path):
    root = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "import pkg.a\n",
        "pkg/x/__init__.py": "",
        "pkg/x/y.py": "from pkg.x import z\n",
        "pkg/x/z.py": "from .y import f\n",
    })
    graph = import_graph(root, "pkg")
    cycles = find_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b"], ["pkg.x.y", "pkg.x.z"]]
    assert describe(graph, cycles) == ("  pkg.a <-> pkg.b   (e.g. pkg.a -> pkg.b -> pkg.a)\n"
                                       "  pkg.x.y <-> pkg.x.z   (e.g. pkg.x.y -> pkg.x.z -> pkg.x.y)")


def test_a_three_module_cycle_with_a_shortcut(tmp_path):
    # online -> grpo -> online and online -> ppo -> online: one component of three modules
    root = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/online.py": "from pkg import grpo, ppo\n",
        "pkg/grpo.py": "from pkg.online import Trainer\n",
        "pkg/ppo.py": "def f():\n    from pkg.online import Trainer\n",
    })
    graph = import_graph(root, "pkg")
    assert find_cycles(graph) == [["pkg.grpo", "pkg.online", "pkg.ppo"]]
    assert cycle_path(graph, ["pkg.grpo", "pkg.online", "pkg.ppo"]) == ["pkg.grpo", "pkg.online", "pkg.grpo"]


def test_the_walk_covers_every_file_of_the_package():
    expected = {
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, fs in os.walk(ROOT / "alignax") for f in fs if f.endswith(".py")
    }
    found = {str(p.relative_to(ROOT)) for p in package_modules(ROOT, "alignax").values()}
    assert found == expected
