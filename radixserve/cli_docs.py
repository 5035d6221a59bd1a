"""docs/configuration.md's option reference, generated from the CLI's own argparse parsers.

    python -m radixserve.cli_docs            # print the reference
    python -m radixserve.cli_docs --write    # rewrite it in docs/configuration.md

A hand-kept list of options drifts as flags are added (it once omitted 30); this walks every
subcommand's parser and writes one row per option: its spellings, the subcommands that take
it, its default and its help. ``tests/cli/test_cli_docs.py`` fails when the page's block is
not what this prints, or when an option is missing from it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

BEGIN, END = "<!-- cli-reference -->", "<!-- /cli-reference -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Subcommand name -> its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's options (not positionals, not --help)."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    d = action.default
    if d is None or d is argparse.SUPPRESS or d == []:
        return ""
    return f"`{d}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        params = {**vars(action), "prog": ""}
        params["choices"] = ", ".join(map(str, action.choices or []))
        text = text % params
    if action.choices and "choices" not in text:
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return " ".join(text.replace("|", "\\|").split())


def reference(parser: argparse.ArgumentParser) -> str:
    """The Markdown table: one row per distinct option, in alphabetical order."""
    rows: dict[str, tuple[str, dict[str, str], str]] = {}  # spellings, subcommand -> default, help
    for name, sub in sorted(subparsers(parser).items()):
        for action in options(sub):
            key = max(action.option_strings, key=len)
            spellings = ", ".join(f"`{s}`" for s in action.option_strings)
            rows.setdefault(key, (spellings, {}, _help(action)))[1][name] = _default(action)
    out = ["| option | subcommands | default | what |", "| --- | --- | --- | --- |"]
    for key in sorted(rows, key=lambda k: k.lstrip("-").lower()):
        spellings, defaults, help_ = rows[key]
        if len(set(defaults.values())) == 1:
            default = next(iter(defaults.values()))
        else:  # the same option with another default per subcommand
            default = "; ".join(f"{n}: {d or 'none'}" for n, d in defaults.items())
        out.append(f"| {spellings} | {', '.join(defaults)} | {default} | {help_} |")
    return "\n".join(out)


def render(page: str, parser: argparse.ArgumentParser) -> str:
    """The page with its block between the markers replaced by :func:`reference`."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise ValueError(f"{PAGE.name} has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: f"{BEGIN}\n{reference(parser)}\n{END}", page)


def main(argv: list[str] | None = None) -> int:
    from radixserve.cli import build_parser

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--write", action="store_true", help=f"rewrite the block in {PAGE}")
    args = ap.parse_args(argv)
    parser = build_parser()
    if args.write:
        PAGE.write_text(render(PAGE.read_text(), parser))
    else:
        sys.stdout.write(reference(parser) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
