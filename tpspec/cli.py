"""The ``tpspec`` command line.

Each subcommand lives in the module that owns its work; that module exposes
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). A command's module is
imported only once the command is chosen (:class:`LazySubcommands`), and those modules
import torch only when they run, so ``tpspec --help``, ``tpspec --version`` and
``tpspec COMMAND --help`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tpspec.runtime.generate_cli", "generate text with a TP model (default: tiny model, TP=2, CPU)"),
    "bench": ("tpspec.bench", "benchmarks: exchange, step, generate, serve, attention"),
    "check": ("tpspec.check_cli", "the determinism suite (docs/determinism.md): pass/fail table"),
    "serve": ("tpspec.serve.cli", "an OpenAI-compatible HTTP server (needs the 'serve' extra)"),
    "make-tiny-model": ("tpspec.model.tiny", "write a small Llama checkpoint in HF format"),
    "convert-eagle3": ("tpspec.model.eagle3_convert", "turn a pytorch_model.bin EAGLE-3 head into safetensors"),
}


class LazySubcommands(argparse._SubParsersAction):  # noqa: SLF001 - argparse's documented action= hook
    """Subcommands whose arguments are added only when one is chosen on the command line:
    :meth:`add_lazy` registers a subcommand with the function that completes its parser."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._complete: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def add_lazy(self, name: str, complete: Callable[[argparse.ArgumentParser], None],
                 **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand ``name`` (``kwargs`` as for ``add_parser``); ``complete(its parser)`` runs
        when it is chosen, before its arguments are parsed."""
        parser = self.add_parser(name, **kwargs)
        self._complete[name] = complete
        return parser

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        complete = self._complete.pop(values[0], None) if values else None
        if complete is not None:
            complete(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


def lazy_subcommands(parser: argparse.ArgumentParser, *, dest: str, metavar: str) -> LazySubcommands:
    """Required subcommands of ``parser`` (chosen one stored in ``dest``) whose modules load on choice."""
    sub = parser.add_subparsers(dest=dest, metavar=metavar, action=LazySubcommands)
    sub.required = True
    return sub


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``tpspec`` parser (``argv`` is not needed; kept for callers that pass it)."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="tpspec", description="tensor-parallel speculative decoding runtime")
    parser.add_argument("--version", action="version", version=f"tpspec {__version__}")
    sub = lazy_subcommands(parser, dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        cmd = sub.add_lazy(name, lambda p, m=module_name: importlib.import_module(m).add_arguments(p),
                           help=help_text, description=help_text)
        cmd.set_defaults(_module=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
