"""The package's import graph, read from the sources (no import runs):
no cycle anywhere, and the lookup core never imports the distributed layer
(README, Layout: the few places that know about collective mode), not even
through another module or a package's `__init__`."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# Installed layout: these folders are subpackages of group_embedding.
FOLDERS = {"group_embedding": "group_embedding",
           "feature_column": "group_embedding.feature_column",
           "ops": "group_embedding.ops"}
# Modules that may import group_embedding.distributed: the package's
# public namespace, the DeepRec name table (it installs the distributed
# API under DeepRec's names) and its public alias, and the estimator (a
# training harness that runs collective jobs). No other module may reach
# distributed, directly or through one of these.
MAY_IMPORT_DISTRIBUTED = ("group_embedding", "group_embedding.compat",
                          "group_embedding.deeprec.name_table",
                          "group_embedding.estimator")
ROOT_PACKAGE = "group_embedding"


def _modules():
    """{module name: file path} of every module of the installed package."""
    found = {}
    for folder, package in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, base)
            prefix = package if rel == "." else (
                package + "." + rel.replace(os.sep, "."))
            for f in files:
                if not f.endswith(".py"):
                    continue
                name = (prefix if f == "__init__.py"
                        else f"{prefix}.{f[:-3]}")
                found[name] = os.path.join(dirpath, f)
    return found


def _imports(path, name, modules):
    """Module-level and function-level imports of one module, resolved to
    modules of the package (`from p import m` names module p.m when it
    exists, else p)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    package = name if path.endswith("__init__.py") else (
        name.rpartition(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                       else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(p, m, modules) for m, p in modules.items()}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}
    stack = []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + "."):
                continue  # a package importing its own submodules
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle(graph):
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    # The check above must be able to fail.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [
        "a", "b", "c", "a"]


def test_core_never_imports_the_distributed_layer(graph):
    offenders = sorted(
        (m, n) for m, deps in graph.items() for n in deps
        if n.startswith("group_embedding.distributed")
        and not m.startswith("group_embedding.distributed")
        and not any(m == a or m.startswith(a + ".")
                    for a in MAY_IMPORT_DISTRIBUTED if a != "group_embedding")
        and m != "group_embedding")
    assert not offenders, offenders


def _with_package_edges(graph):
    """`graph` plus the edges Python adds: importing `a.b.c` runs the
    `__init__` of `a.b` too. The root package is left out, as a parent and
    as a target: importing any module runs it, and it is the public
    namespace (it imports everything)."""
    out = {}
    for m, deps in graph.items():
        targets = set(deps) - {ROOT_PACKAGE}
        for n in deps:
            parent = n.rpartition(".")[0]
            while parent and parent != ROOT_PACKAGE:
                if parent in graph and parent != m:
                    targets.add(parent)
                parent = parent.rpartition(".")[0]
        out[m] = targets
    return out


def _chain_to(graph, start, is_target):
    """The shortest import chain from `start` to a module `is_target`
    accepts, as a list of modules, or None (breadth first)."""
    previous = {start: None}
    queue = [start]
    while queue:
        m = queue.pop(0)
        for n in sorted(graph.get(m, ())):
            if n in previous:
                continue
            previous[n] = m
            if is_target(n):
                chain = [n]
                while previous[chain[-1]] is not None:
                    chain.append(previous[chain[-1]])
                return chain[::-1]
            queue.append(n)
    return None


def _is_distributed(m):
    return m == "group_embedding.distributed" or m.startswith(
        "group_embedding.distributed.")


def _may_import_distributed(m):
    return _is_distributed(m) or any(
        m == a or (a != ROOT_PACKAGE and m.startswith(a + "."))
        for a in MAY_IMPORT_DISTRIBUTED)


def test_nothing_else_reaches_the_distributed_layer(graph):
    # Through any chain of imports, package `__init__`s included: an
    # exporter that imports an estimator module runs the estimator
    # package, which imports distributed.
    full = _with_package_edges(graph)
    chains = [_chain_to(full, m, _is_distributed) for m in sorted(full)
              if not _may_import_distributed(m)]
    chains = [" -> ".join(c) for c in chains if c]
    assert not chains, "\n".join(chains)


def test_the_chain_finder_sees_package_inits():
    # The check above must be able to fail on a package `__init__` edge.
    graph = {"group_embedding.export.a": {"group_embedding.estimator.w"},
             "group_embedding.estimator.w": set(),
             "group_embedding.estimator": {"group_embedding.estimator.e"},
             "group_embedding.estimator.e": {
                 "group_embedding.distributed.s"},
             "group_embedding.distributed.s": set()}
    assert _chain_to(_with_package_edges(graph),
                     "group_embedding.export.a", _is_distributed) == [
        "group_embedding.export.a", "group_embedding.estimator",
        "group_embedding.estimator.e", "group_embedding.distributed.s"]


def test_import_loads_neither_the_estimator_nor_horovod():
    import subprocess
    import sys
    code = ("import sys, group_embedding as ge\n"
            "print(sorted(m for m in sys.modules if m == 'horovod' or "
            "m.startswith('group_embedding.estimator')))\n"
            "ge.estimator.Estimator\n"
            "print('group_embedding.estimator' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
