"""Subcommands of the ``radixserve`` CLI, one module each, found by :func:`radixserve.cli.load_commands`.

Each module registers its commands with :func:`radixserve.cli.register` and imports heavy
libraries (torch, transformers) only inside the handler, so ``radixserve --help`` stays fast.
"""
