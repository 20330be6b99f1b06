"""The ``tpspec`` command line.

Each subcommand lives in the module that owns its work; that module exposes
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Modules are
imported only when their subcommand is parsed, so ``tpspec --help`` and ``tpspec --version``
never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tpspec.runtime.generate_cli", "generate text with a TP model (default: tiny model, TP=2, CPU)"),
    "bench": ("tpspec.bench", "benchmarks: exchange, step, generate, attention"),
    "check": ("tpspec.check", "the determinism suite (docs/determinism.md): pass/fail table"),
    "serve": ("tpspec.serve.cli", "an OpenAI-compatible HTTP server (needs the 'serve' extra)"),
    "make-tiny-model": ("tpspec.model.tiny", "write a small Llama checkpoint in HF format"),
    "convert-eagle3": ("tpspec.model.eagle3", "turn a pytorch_model.bin EAGLE-3 head into safetensors"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="tpspec", description="tensor-parallel speculative decoding runtime")
    parser.add_argument("--version", action="version", version=f"tpspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module_name)
        if name == wanted:  # only the chosen command pays for its imports
            importlib.import_module(module_name).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
