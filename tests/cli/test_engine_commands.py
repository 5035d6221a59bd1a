"""``radixserve generate`` and ``radixserve demo`` on a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


def test_generate_json(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--num-pages",
            "256",
            "--page-size",
            "4",
            "--max-tokens",
            "5",
            "--json",
            "Hello, world!",
            "The quick brown fox",
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello, world!", "The quick brown fox"]
    assert all(
        x["usage"]["completion_tokens"] == 5 and x["finish_reason"] == "length" for x in lines
    )


def test_generate_chat_and_bad_option(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_llama_dir),
                "--num-pages",
                "256",
                "--max-tokens",
                "3",
                "--system",
                "Be brief.",
                "Hi",
            ]
        )
        == 0
    )
    assert "tok/s" in capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_llama_dir),
                "--num-pages",
                "256",
                "--temperature",
                "-1",
                "Hi",
            ]
        )
        == 1
    )
    assert "temperature" in capsys.readouterr().err


def test_demo_prints_reuse_figures(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["demo", "--model", str(tiny_llama_dir), "--num-pages", "512", "--max-tokens", "4"])
        == 0
    )
    out = capsys.readouterr().out
    assert "hit rate" in out and "cached" in out and "tok/s" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("turn 2")]
    assert len(rows) == 4 and all(int(r[-2]) > 300 for r in rows)  # the whole history was reused


def test_generate_twice_over_a_storage_dir_starts_warm(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--num-pages",
        "64",
        "--page-size",
        "4",
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--json",
        "--hicache-storage-dir",
        str(tmp_path),
        "a long prompt " * 8,
    ]
    runs = []
    for _ in range(2):  # two processes' worth of engines: the second finds the first's page files
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["usage"]["cached_tokens"] == 0 < runs[1]["usage"]["cached_tokens"]
    assert runs[0]["text"] == runs[1]["text"]
