"""The docs name what exists: every import in README.md's and docs/guide.md's Python examples
imports, and every --flag the docs write on a `jspec` command line is a flag of some jspec command
(a renamed function or flag fails here, not in a reader's first try)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "ARCHITECTURE.md",
        ROOT / "benchmarks" / "README.md"]


def python_blocks(path: Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def imports(block: str) -> list[str]:
  """The block's import statements, as source lines (a fragment need not parse as a whole)."""
  lines, out = block.splitlines(), []
  for i, line in enumerate(lines):
    if re.match(r"\s*(import|from)\s+\S+", line):
      statement = line
      while statement.rstrip().endswith(("(", ",")) and i + 1 < len(lines):  # a wrapped import
        i += 1
        statement += "\n" + lines[i]
      out.append(statement.strip())
  return out


@pytest.mark.parametrize("path", DOCS[:2], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_in_the_examples_imports(path):
  statements = [s for block in python_blocks(path) for s in imports(block)]
  assert statements, f"{path.name}: no Python example found"
  for statement in statements:
    ast.parse(statement)
    exec(compile(statement, f"{path.name}: {statement}", "exec"), {})


def cli_flags() -> set[str]:
  """Every option string of every jspec command."""
  import argparse
  from jspec.cli import build_parser
  parser, flags = build_parser(), set()
  stack = [parser]
  while stack:
    p = stack.pop()
    for action in p._actions:
      flags.update(s for s in action.option_strings if s.startswith("--"))
      if isinstance(action, argparse._SubParsersAction):
        stack.extend(action.choices.values())
  return flags


# Flags the docs write that belong to other programs (pip, pytest, python, XLA, the benchmark
# scripts under benchmarks/, which the docs run with their own flags).
OTHER_PROGRAMS = re.compile(r"pip |pytest|python |XLA_FLAGS|benchmarks/\S+\.py|\.ci/")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_jspec_flag_the_docs_write_exists(path):
  """On lines that run `jspec` (or continue such a command), each --flag is a jspec flag."""
  known, unknown, checked = cli_flags(), [], 0
  in_command = False
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if re.search(r"(^|[`\s(])jspec [a-z-]+", line) and not OTHER_PROGRAMS.search(line):
      in_command = True
    elif not in_command:
      continue
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*-])", line):
      checked += 1
      if flag not in known:
        unknown.append(f"{path.name}:{number}: {flag}")
    in_command = line.rstrip().endswith("\\")
  if path.name != "ARCHITECTURE.md":  # (it shows no command lines)
    assert checked >= 5, f"{path.name}: {checked} jspec flags found; the line pattern broke?"
  assert not unknown, unknown
