"""The `jspec` command: generate text and benchmark decoding.

One module per group of commands (generate, bench, train), the flags they share (options), the
checks run before anything loads (checks), what commands stamp on their records (records) and the
parser that ties them together (parser); `python -m jspec.cli` runs main (__main__)."""

from __future__ import annotations

import sys

from jspec.cli.checks import check_args
from jspec.cli.parser import build_parser
from jspec.cli.records import set_command_line

__all__ = ["build_parser", "check_args", "main"]


def main(argv: list[str] | None = None) -> int:
  set_command_line(argv)
  args = build_parser().parse_args(argv)
  from jspec.io import compilation_cache
  compilation_cache.enable()
  from jspec.models.numerics import matmul_precision
  try:
    check_args(args)
    with matmul_precision(getattr(args, "precision", "fast")):  # every program the command traces
      return args.fn(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"jspec: error: {e}", file=sys.stderr)
    return 2
