"""The map in code: no import cycles, each runtime layer imports only the layers under it,
``serving/``'s folders (one per process) import only what their process may know of the
others, and the clients' side (the prompt DSL, the ZeroMQ clients) imports without torch.

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
# distributed/ stands beside engine/: it runs the engine's runner on the other ranks, and the
# engine reaches it only through its topology factory (tests/distributed/test_topology.py).
LAYERS = ["memory", "model", "scheduling", "engine", "agents", "serving", "commands"]
SAME_LAYER = {"distributed": "engine", "speculative": "scheduling"}
# serving/'s folders and which of the others each may import. "" is serving/'s own modules,
# shared by several processes (text handling, process exit). The router talks to workers
# and clients over sockets, never through their code; what crosses a socket is the wire's.
SERVING_MAY_IMPORT: dict[str, set[str]] = {
    "wire": set(),
    "": {"wire"},
    "client": {"wire"},
    "router": {"wire", ""},
    "worker": {"wire", ""},
    "http": {"wire", "", "client"},
}
# model/'s own levels, bottom-up: a module of model/ imports only from its level or those under
# it. quant/ (formats, quantized linears) stands with the kernels because the decoder layers use
# its linears; what walks a built model (quantize it, build it from GGUF, load it) stands above
# the model. A new module of model/ is placed here (test_every_model_module_has_a_level).
MODEL_LEVELS: list[set[str]] = [
    {
        "native",
        "gpu_ops",
        "cpu_gemv",
        "cpu_linear",
        "quant",
        "config",
        "classifier",
        "families",
        "forward_batch",
        "parallel",
        "tp_shard",
        "lora",
    },
    {"attention", "layers"},
    {"decoder_stack", "llama", "pipeline_stage"},
    {"loader", "quantize", "gguf_loader", "warmup", "weight_update"},
    {"weight_release"},  # what an update writes, given back to the OS
]
# The longest chain of imports inside one serving folder (a module that imports nothing of its
# folder is level 1; the router's is prefix_trie < dispatch < worker_pool < inflight <
# from_workers < router < launcher). A folder past this limit is asking to be split.
MAX_FOLDER_LEVELS = 7


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
    if parts[0] != "radixserve" or len(parts) < 2:
        return None
    name = SAME_LAYER.get(parts[1], parts[1])
    return LAYERS.index(name) if name in LAYERS else None


def _model_level(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["radixserve", "model"] or len(parts) < 3:
        return None
    return next((i for i, names in enumerate(MODEL_LEVELS) if parts[2] in names), None)


def _model_upward(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for mod, targets in graph.items():
        here = _model_level(mod)
        for t in targets:
            there = _model_level(t)
            if here is not None and there is not None and there > here:
                upward.append(f"{mod} -> {t}")
    return sorted(upward)


def _serving_folder(module: str) -> str | None:
    """The serving folder of a module of radixserve.serving ("" for serving's own modules)."""
    parts = module.split(".")
    if parts[:2] != ["radixserve", "serving"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SERVING_MAY_IMPORT else ""


def _folder_levels(graph: dict[str, set[str]], folder: str) -> dict[str, int]:
    inside = {m for m in graph if _serving_folder(m) == folder and m.count(".") > 2}
    levels: dict[str, int] = {}

    def level(m: str) -> int:
        if m not in levels:
            levels[m] = 1 + max((level(t) for t in graph[m] if t in inside), default=0)
        return levels[m]

    for m in inside:
        level(m)
    return levels


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


def test_model_levels_import_only_downward() -> None:
    """quant/ imports nothing of the model it serves; the model, nothing of its loader."""
    assert _model_upward(_import_graph()) == []


def test_every_model_module_has_a_level() -> None:
    unplaced = sorted(
        m
        for m in _import_graph()
        if m.count(".") >= 2 and m.startswith("radixserve.model.") and _model_level(m) is None
    )
    assert unplaced == [], "place these in MODEL_LEVELS"


def test_the_model_levels_catch_an_upward_import() -> None:
    graph = {
        "radixserve.model.quant.apply": {"radixserve.model.llama", "radixserve.model.quant.linear"},
        "radixserve.model.llama": {"radixserve.model.decoder_stack", "radixserve.model.quantize"},
        "radixserve.model.quantize": {"radixserve.model.llama"},
    }
    assert _model_upward(graph) == [
        "radixserve.model.llama -> radixserve.model.quantize",
        "radixserve.model.quant.apply -> radixserve.model.llama",
    ]


def _forbidden_crossings(graph: dict[str, set[str]]) -> list[str]:
    crossing = []
    for mod, targets in graph.items():
        here = _serving_folder(mod)
        if here is None:
            continue
        for t in targets:
            there = _serving_folder(t)
            if there is not None and there != here and there not in SERVING_MAY_IMPORT[here]:
                crossing.append(f"{mod} -> {t}")
    return sorted(crossing)


def test_serving_folders_import_only_what_their_process_may_know() -> None:
    """wire/ imports nothing of the others; router/ and worker/ never import each other or the
    clients; client/ only the wire (so it installs light); http/ the clients, not the router."""
    folders = {p.name for p in (ROOT / "radixserve" / "serving").iterdir() if p.is_dir()}
    assert set(SERVING_MAY_IMPORT) - {""} == folders - {"__pycache__"}
    assert _forbidden_crossings(_import_graph()) == []


def test_the_folder_rules_catch_a_crossing() -> None:
    graph = {
        "radixserve.serving.router.a": {"radixserve.serving.worker.b", "radixserve.serving.wire.c"},
        "radixserve.serving.client.d": {
            "radixserve.serving.router.a",
            "radixserve.serving.prompts",
        },
        "radixserve.serving.wire.c": {"radixserve.serving.shutdown"},
        "radixserve.serving.http.e": {"radixserve.serving.client.d", "radixserve.engine.f"},
    }
    assert _forbidden_crossings(graph) == [
        "radixserve.serving.client.d -> radixserve.serving.prompts",
        "radixserve.serving.client.d -> radixserve.serving.router.a",
        "radixserve.serving.router.a -> radixserve.serving.worker.b",
        "radixserve.serving.wire.c -> radixserve.serving.shutdown",
    ]
    assert _folder_levels(graph, "router") == {"radixserve.serving.router.a": 1}


def test_serving_is_not_one_flat_folder() -> None:
    """Every module of serving/ lives in its process's folder, except the few that several
    processes run; each folder's import chains stay short."""
    graph = _import_graph()
    shared = sorted(m for m in graph if _serving_folder(m) == "" and m != "radixserve.serving")
    assert shared == ["radixserve.serving.prompts", "radixserve.serving.shutdown"]
    for folder in SERVING_MAY_IMPORT:
        if folder:
            deepest = max(_folder_levels(graph, folder).values())
            assert deepest <= MAX_FOLDER_LEVELS, (folder, deepest)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_clients_import_without_torch() -> None:
    code = (
        "import sys; import radixserve, frontend_dsl, frontend_dsl.remote_backend, "
        "radixserve.serving.client, radixserve.serving.wire.protocol; "
        "bad = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules); "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# The longest function of radixserve/ in lines, from ``def`` to its last line, docstring
# included: one a reader takes in at once. A longer one is cut where its steps are. No
# function is excepted.
MAX_FUNCTION_LINES = 95


def _long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{f.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    assert _long_functions(ROOT / "radixserve", MAX_FUNCTION_LINES) == []


def test_the_length_rule_finds_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(
        f"def short() -> None:\n    pass\n\n\ndef long() -> None:\n{body}"
    )
    assert _long_functions(tmp_path, MAX_FUNCTION_LINES) == [
        f"m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"
    ]
