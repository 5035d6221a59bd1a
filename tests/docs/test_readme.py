"""The README's quick start runs as written, so the docs cannot drift from the code.

The quick start is the region of README.md between ``<!-- quickstart -->`` and
``<!-- /quickstart -->``. Its fenced ``python`` and ``bash`` blocks run in order:

- blocks before the server block run on their own (the offline engine, ``radixserve generate``);
- the one block that starts ``radixserve serve`` starts the server, in the background;
- every later block runs against that server, with the README's ports (ZeroMQ 5555, HTTP
  8000) replaced by free loopback ports, so the test never collides with another server.

Running them needs the real default model, so those tests are ``slow`` (CI runs them). The
fast tests check what needs no model: the region's shape, that every block parses, that
every ``radixserve`` command line parses with the real CLI parser, and that every relative
link in README.md, docs/ and benchmarks/README.md resolves.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import Proc, gone, start  # noqa: E402  (the HTTP tests' server helpers)

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BEGIN, END = "<!-- quickstart -->", "<!-- /quickstart -->"
ZMQ_PORT, HTTP_PORT = "5555", "8000"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
BLOCK_TIMEOUT = 600.0


@dataclass(frozen=True)
class Block:
    """One fenced block of the quick start: its language, code and line in README.md."""

    lang: str
    code: str
    line: int

    @property
    def starts_server(self) -> bool:
        return self.lang == "bash" and self.code.lstrip().startswith("radixserve serve")

    @property
    def id(self) -> str:
        return f"{self.lang}@README.md:{self.line}"


def quickstart_blocks(text: str) -> list[Block]:
    """The fenced blocks between the quick-start markers, in order."""
    start_at, end_at = text.find(BEGIN), text.find(END)
    assert 0 <= start_at < end_at, f"README.md has no {BEGIN} ... {END} region"
    region = text[start_at:end_at]
    first_line = text.count("\n", 0, start_at) + 1
    return [
        Block(m.group(1), m.group(2), first_line + region.count("\n", 0, m.start()))
        for m in FENCE.finditer(region)
    ]


BLOCKS = quickstart_blocks(README.read_text())
_server_at = next((i for i, b in enumerate(BLOCKS) if b.starts_server), len(BLOCKS))
OFFLINE = BLOCKS[:_server_at]
SERVER = BLOCKS[_server_at] if _server_at < len(BLOCKS) else None
ONLINE = BLOCKS[_server_at + 1 :]


def command_lines(code: str) -> Iterator[list[str]]:
    """The ``radixserve ...`` command lines of a bash block, split as the shell would."""
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "radixserve":
            yield argv[1:]


# ---------------------------------------------------------------------------------- fast


def test_quickstart_covers_every_way_in() -> None:
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}, [b.id for b in BLOCKS]
    assert SERVER is not None and sum(b.starts_server for b in BLOCKS) == 1
    code = "\n".join(b.code for b in BLOCKS)
    for needle in (
        "from radixserve import Engine",
        "from openai import OpenAI",
        "from frontend_dsl import",
        "from radixserve.serving.client import Client",
    ):
        assert needle in code, f"the quick start lost its {needle!r} example"
    assert all(b.lang == "bash" or "Engine(" in b.code for b in OFFLINE)


def test_online_blocks_talk_to_the_readme_server() -> None:
    """Every block after the server names its port, so the test can point it at its own server."""
    assert SERVER is not None and ZMQ_PORT in SERVER.code and HTTP_PORT in SERVER.code
    for b in ONLINE:
        assert ZMQ_PORT in b.code or HTTP_PORT in b.code, (
            f"{b.id} does not say which server it talks to"
        )


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_parses(block: Block) -> None:
    if block.lang == "python":
        compile(block.code, block.id, "exec")
    else:
        r = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def main_job() -> str:
    """The main-job command: the first bash block under "## The two commands"."""
    text = README.read_text()
    section = text[text.index("## The two commands") :]
    m = FENCE.search(section)
    assert m is not None and m.group(1) == "bash", "README.md lost its main-job command"
    return m.group(2)


def test_main_job_names_what_exists() -> None:
    """The main job's scripts exist and its ``radixserve`` commands are real (it is not run here:
    it installs packages; the quick start's blocks run the same commands below)."""
    job = main_job()
    for script in re.findall(r"python (\S+\.py)", job):
        assert (REPO / script).is_file(), f"the main job runs {script}, which does not exist"
    assert (REPO / ".ci" / "run").is_file()


def test_radixserve_commands_parse() -> None:
    """Every ``radixserve`` command of the quick start and the main job parses with the CLI."""
    from radixserve.cli import build_parser

    parser = build_parser()
    argvs = [argv for b in BLOCKS if b.lang == "bash" for argv in command_lines(b.code)]
    # The main job is one shell line: split it at the shell's separators first.
    for part in re.split(r"&&|;|\(|\)|&", main_job()):
        argvs += command_lines(part)
    assert sum(argv[:1] == ["serve"] for argv in argvs) >= 2  # the quick start's and the main job's
    for argv in argvs:
        try:
            parser.parse_args(argv)
        except SystemExit as e:  # argparse reports to stderr and exits 2
            pytest.fail(f"radixserve {shlex.join(argv)}: rejected by the CLI ({e})")


LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_FILES = [
    README,
    REPO / "benchmarks" / "README.md",
    REPO / "benchmarks" / "agents.md",
    REPO / "benchmarks" / "cluster.md",
    REPO / "benchmarks" / "long_context.md",
    REPO / "benchmarks" / "long_context_history.md",
    REPO / "benchmarks" / "model_families.md",
    *sorted((REPO / "docs").glob("*.md")),
]


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path) -> None:
    text = doc.read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(target)
    assert not broken, f"{doc.relative_to(REPO)}: broken links {broken}"


# Words that speak of how the project was built, not of what it is, or of a machine unnamed.
HISTORY = re.compile(
    r"\b((this|first|second|third) session|the issue's|the article|this machine|earlier rounds?)\b",
    re.I,
)


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_speak_of_the_project_not_its_history(doc: Path) -> None:
    found = sorted({m.group(0) for m in HISTORY.finditer(doc.read_text())})
    assert not found, f"{doc.relative_to(REPO)} says {found}: say what it is, and name the machine"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens."""
    heads = re.findall(
        r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), re.M
    )
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


# ---------------------------------------------------------------------------------- slow


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(block: Block, ports: dict[str, str]) -> None:
    code = block.code
    for old, new in ports.items():
        code = re.sub(rf"\b{old}\b", new, code)
    # `python` and `radixserve` in a bash block are this interpreter's.
    env = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    argv = (
        [sys.executable, "-c", code]
        if block.lang == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    r = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
    )
    print(r.stdout)  # shown with -s: what the README's reader would see
    assert r.returncode == 0, f"{block.id} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"{block.id} printed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("block", OFFLINE, ids=lambda b: b.id)
def test_offline_block_runs(block: Block, smollm2_dir: Path) -> None:
    _run(block, {})


@dataclass
class ReadmeServer:
    proc: Proc
    ports: dict[str, str]


@pytest.fixture(scope="module")
def readme_server(smollm2_dir: Path) -> Iterator[ReadmeServer]:
    """The quick start's ``radixserve serve`` on free ports; stopped with its workers at the end."""
    assert SERVER is not None
    ports = {ZMQ_PORT: _free_port(), HTTP_PORT: _free_port()}
    code = re.sub(rf"\b({ZMQ_PORT}|{HTTP_PORT})\b", lambda m: ports[m.group(1)], SERVER.code)
    (argv,) = command_lines(code)
    out = start(argv)
    try:
        out.wait_for(r"HTTP on http://", timeout=300)
        pids = [int(p) for p in out.wait_for(r"worker pids ([\d ]+)", timeout=300).group(1).split()]
    except BaseException:
        out.stop()
        raise
    yield ReadmeServer(out, ports)
    assert out.stop() == 0, "".join(out.seen)
    assert all(gone(pid) for pid in pids), "a worker outlived the README's server"


@pytest.mark.slow
@pytest.mark.parametrize("block", ONLINE, ids=lambda b: b.id)
def test_online_block_runs(block: Block, readme_server: ReadmeServer) -> None:
    _run(block, readme_server.ports)
