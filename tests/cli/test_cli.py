"""The radixserve CLI: help lists the registered subcommands; errors are one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve.cli import COMMANDS, build_parser, main, register


def test_help_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "radixserve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("fetch-model", "memory"):
        assert name in out


def test_help_does_not_import_torch() -> None:
    code = "import sys; from radixserve.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "commands" in capsys.readouterr().out


def test_register_extends_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    @register(
        "hello-test", help="test command", arguments=lambda p: p.add_argument("--name", default="x")
    )
    def hello(args):  # type: ignore[no-untyped-def]
        print(f"hello {args.name}")
        return 0

    try:
        assert "hello-test" in build_parser().format_help()
        assert main(["hello-test", "--name", "radix"]) == 0
        assert capsys.readouterr().out == "hello radix\n"
        with pytest.raises(ValueError, match="registered twice"):
            register("hello-test", help="again")(lambda a: 0)
    finally:
        COMMANDS.pop("hello-test", None)


def test_bad_model_path_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert main(["memory", "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("radixserve memory: error:") and "Traceback" not in err
