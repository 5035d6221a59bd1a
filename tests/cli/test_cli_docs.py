"""docs/configuration.md documents every option of every subcommand, as the parsers define it."""

from __future__ import annotations

from radixserve import cli_docs
from radixserve.cli import build_parser


def test_every_option_of_every_subcommand_is_documented() -> None:
    parser = build_parser()
    page = cli_docs.PAGE.read_text()
    block = page[page.index(cli_docs.BEGIN) : page.index(cli_docs.END)]
    subs = cli_docs.subparsers(parser)
    assert {"serve", "generate", "fetch-model", "build-kernels"} <= set(subs)
    missing = [
        f"radixserve {name} {opt}"
        for name, sub in subs.items()
        for action in cli_docs.options(sub)
        for opt in action.option_strings
        if f"`{opt}`" not in block
    ]
    assert not missing, (
        f"docs/configuration.md lacks {missing} (python -m radixserve.cli_docs --write)"
    )


def test_reference_block_is_what_the_parsers_give() -> None:
    page = cli_docs.PAGE.read_text()
    assert cli_docs.render(page, build_parser()) == page, (
        "docs/configuration.md's option table is stale: python -m radixserve.cli_docs --write"
    )


def test_a_shared_option_with_other_defaults_names_each() -> None:
    ref = cli_docs.reference(build_parser())
    row = next(line for line in ref.splitlines() if line.startswith("| `--log-level`"))
    assert "serve: `WARNING`" in row and "gateway: `INFO`" in row
