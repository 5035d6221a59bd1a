"""The map in code: no import cycles, each runtime layer imports only the layers under it,
and the clients' side (the prompt DSL, the ZeroMQ clients) imports without torch.

Imports are read from the source (``ast``), module-level, function-level and
``TYPE_CHECKING`` ones alike: a cycle hidden behind a lazy import is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "radixserve": ROOT / "radixserve",
    "frontend_dsl": ROOT / "frontend_dsl",
    "radixkernels": ROOT / "kernels",
}
# radixserve's runtime layers, bottom-up: a module imports only from its layer or those under it.
LAYERS = ["memory", "model", "scheduling", "engine", "agents", "serving", "commands"]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [pkg, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                found = resolve(t)
                if found is not None and found != mod:
                    graph[mod].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return (
        LAYERS.index(parts[1])
        if parts[0] == "radixserve" and len(parts) > 1 and parts[1] in LAYERS
        else None
    )


def test_no_import_cycles() -> None:
    assert _cycles(_import_graph()) == []


def test_layers_import_only_downward() -> None:
    upward = []
    for mod, targets in _import_graph().items():
        here = _layer(mod)
        for t in targets:
            there = _layer(t)
            if here is not None and there is not None and there > here:
                upward.append(f"{mod} -> {t}")
    assert upward == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_clients_import_without_torch() -> None:
    code = (
        "import sys; import radixserve, frontend_dsl, frontend_dsl.remote_backend, "
        "radixserve.serving.client, radixserve.serving.async_client, radixserve.serving.protocol; "
        "bad = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules); "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
