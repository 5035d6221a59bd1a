"""The ``radixserve`` console command: argparse with a registry of subcommands.

Adding a subcommand takes one new module in ``radixserve/commands/`` (found automatically)::

    from radixserve.cli import register

    def _arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="default")

    @register("generate", help="offline generation with the engine", arguments=_arguments)
    def generate(args: argparse.Namespace) -> int:
        from radixserve.engine.engine import Engine   # heavy imports inside: --help stays fast
        ...
        return 0

Command modules must not import torch at module level: ``radixserve --help`` imports them all.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ArgumentsFn = Callable[[argparse.ArgumentParser], None]
RunFn = Callable[[argparse.Namespace], "int | None"]


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument definitions and handler."""

    name: str
    help: str
    arguments: ArgumentsFn | None
    run: RunFn


COMMANDS: dict[str, Command] = {}


def register(
    name: str, help: str, arguments: ArgumentsFn | None = None
) -> Callable[[RunFn], RunFn]:
    """Decorator: register ``fn(args) -> exit code`` as ``radixserve <name>``."""

    def deco(fn: RunFn) -> RunFn:
        if name in COMMANDS and COMMANDS[name].run is not fn:
            raise ValueError(f"subcommand {name!r} registered twice")
        COMMANDS[name] = Command(name, help, arguments, fn)
        return fn

    return deco


def load_commands() -> dict[str, Command]:
    """Import every module of ``radixserve.commands`` so their ``@register`` calls run."""
    import radixserve.commands as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    return COMMANDS


def build_parser() -> argparse.ArgumentParser:
    """The full parser, one subparser per registered command."""
    from radixserve import __version__

    parser = argparse.ArgumentParser(
        prog="radixserve",
        description="radixserve: a prefix-caching LLM serving engine (radix tree over a paged KV cache).",
    )
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for cmd in sorted(load_commands().values(), key=lambda c: c.name):
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.arguments is not None:
            cmd.arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixserve`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    from radixserve.model_store import ModelFetchError

    try:
        return int(args._run(args) or 0)
    except (ModelFetchError, FileNotFoundError, ValueError) as e:
        # Expected failures (no network, bad path, bad option): one clear line, no traceback.
        print(f"radixserve {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
