"""The engine builds its runner through one factory that knows the topology.

``Engine._build`` has one path for one process, tensor-parallel ranks and pipeline stages:
it asks its :class:`~radixserve.distributed.topology.Topology` where they differ. These tests
check that nothing in ``engine/`` tests the parallel sizes or reaches for the rank machinery
itself, and that the one-process topology builds and drives a real engine. (The parallel
topologies are exercised end to end by tests/distributed/test_tensor_parallel.py and
test_pipeline_parallel.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from radixserve.distributed.topology import Topology, make_topology
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "radixserve" / "engine"
# What only the topology may ask or hold: the parallel sizes, the hosts, the rank machinery.
TOPOLOGY_NAMES = {
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "nnodes",
    "node_rank",
    "RankGroup",
    "PipelineLaunch",
    "ranks",
    "pipeline",
}
# config.py declares and validates the sizes; devices.py counts the devices one worker takes.
DECLARE_ONLY = {"config.py", "devices.py"}
# The engine's only ways into distributed/: the factory, the step message the runner sends
# its followers, the rendezvous address check of the config.
ENGINE_MAY_IMPORT = {
    "radixserve.distributed.topology",
    "radixserve.distributed.step_wire",
    "radixserve.distributed.dist_addr",
    # Prefill/decode disaggregation: the engine asks make_role for its role (or None) and
    # talks to it through the role's methods, never to the transfer engine itself.
    "radixserve.distributed.disagg.roles",
}


def _names(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.rpartition(".")[2])
    return found


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_no_topology_checks_outside_the_factory() -> None:
    offenders = {}
    for path in sorted(ENGINE.rglob("*.py")):
        if path.name in DECLARE_ONLY:
            continue
        hits = _names(ast.parse(path.read_text())) & TOPOLOGY_NAMES
        if hits:
            offenders[path.name] = sorted(hits)
    assert offenders == {}


def test_the_engine_reaches_distributed_only_through_its_interfaces() -> None:
    reached = {}
    for path in sorted(ENGINE.rglob("*.py")):
        mods = {
            m
            for m in _imports(ast.parse(path.read_text()))
            if m.startswith("radixserve.distributed")
        }
        if mods - ENGINE_MAY_IMPORT:
            reached[path.name] = sorted(mods - ENGINE_MAY_IMPORT)
    assert reached == {}


def test_the_scan_sees_a_topology_check() -> None:
    code = "if cfg.tensor_parallel_size > 1:\n    self.ranks = RankGroup(cfg)\n"
    assert _names(ast.parse(code)) & TOPOLOGY_NAMES == {
        "tensor_parallel_size",
        "ranks",
        "RankGroup",
    }


def test_one_process_is_the_plain_topology() -> None:
    cfg = EngineConfig.from_kwargs(device="cpu", num_threads=1)
    topo = make_topology(cfg, "unused", {})
    assert type(topo) is Topology and not topo.parallel
    assert topo.device.type == "cpu" and topo.threads() == 1
    assert topo.load_args() == {"tp": None, "stage": None}
    assert topo.on_step_error is None


def test_an_engine_runs_on_its_topology(tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_llama_dir), num_pages=64, page_size=4)
    try:
        assert type(engine.topology) is Topology
        assert "tensor-parallel ranks ready" not in engine.startup_seconds
        out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) == 4
        engine.check_health()
        engine.check_invariants()
    finally:
        engine.close()
