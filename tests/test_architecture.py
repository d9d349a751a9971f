"""The package layers (ARCHITECTURE.md): imports only go downward, there are no import cycles and
no module reaches into another's private names. Read from the source, function-level imports
included, so a lazy import cannot hide a dependency."""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent / "jspec"

# Lowest first; a module may import its own layer and the ones below.
LAYERS = [
    ("jspec.sharding", "jspec.paths", "jspec.native", "jspec.pallas", "jspec.models",
     "jspec.sampling", "jspec.tree", "jspec.kv"),
    ("jspec.io", "jspec.decode", "jspec.data", "jspec.streaming"),
    ("jspec.drafting",),
    ("jspec.generate", "jspec.speculative", "jspec.score"),
    ("jspec.model",),
    ("jspec.train", "jspec.bench"),
    ("jspec.cli", "jspec.__main__"),
]
# What the issue that set up the layers names: no inference module imports the tools above it.
INFERENCE = ("jspec.native", "jspec.models", "jspec.sampling", "jspec.tree", "jspec.pallas", "jspec.kv", "jspec.io",
             "jspec.decode", "jspec.streaming", "jspec.drafting", "jspec.generate",
             "jspec.speculative", "jspec.score")
TOOLS = ("jspec.train", "jspec.bench", "jspec.cli")


def module_name(path: Path, root: Path) -> str:
  parts = path.relative_to(root.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path) -> bool:
  rel = Path(*name.split(".")[1:]) if "." in name else Path()
  return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def imports_of(root: Path | None = None) -> dict[str, list[tuple[str, list[str], int]]]:
  """module -> [(imported jspec module, names taken from it, line)] for every module under root."""
  root = root or ROOT
  out = {}
  for path in sorted(root.rglob("*.py")):
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("jspec")]
      elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jspec"):
        for a in node.names:  # `from jspec.x import y` may name a module y
          sub = f"{node.module}.{a.name}"
          found.append((sub, [], node.lineno) if is_module(sub, root)
                       else (node.module, [a.name], node.lineno))
    out[module_name(path, root)] = found
  return out


def layer_of(module: str) -> int | None:
  for rank, prefixes in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return rank
  return None


def under(module: str, prefixes) -> bool:
  return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_module_has_a_layer():
  missing = [m for m in imports_of() if m != "jspec" and layer_of(m) is None]
  assert not missing, f"add these modules to a layer in LAYERS and ARCHITECTURE.md: {missing}"


def test_inference_never_imports_train_bench_or_cli():
  wrong = [f"{m}:{line} imports {dep}" for m, deps in imports_of().items() if under(m, INFERENCE)
           for dep, _, line in deps if under(dep, TOOLS)]
  assert not wrong, "\n".join(wrong)


def test_imports_only_go_down():
  wrong = [f"{m} (layer {layer_of(m)}):{line} imports {dep} (layer {layer_of(dep)})"
           for m, deps in imports_of().items() if layer_of(m) is not None
           for dep, _, line in deps
           if layer_of(dep) is not None and layer_of(dep) > layer_of(m)]
  assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
  graph = {m: {d for d, _, _ in deps if d != m} for m, deps in imports_of().items()}
  state: dict[str, int] = {}  # 1 on the current path, 2 finished
  cycles = []

  def visit(m: str, path: list[str]) -> None:
    state[m] = 1
    for d in sorted(graph.get(m, ())):
      if state.get(d) == 1:
        cycles.append(" -> ".join(path[path.index(d):] + [d]))
      elif d not in state:
        visit(d, path + [d])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, "\n".join(cycles)


def test_no_private_names_across_modules():
  wrong = []
  for path in sorted(ROOT.rglob("*.py")):
    tree = ast.parse(path.read_text())
    aliases = set()  # names bound to imported jspec modules
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jspec"):
        for a in node.names:
          if a.name.startswith("_"):
            wrong.append(f"{path.name}:{node.lineno} imports {node.module}.{a.name}")
          if is_module(f"{node.module}.{a.name}", ROOT):
            aliases.add(a.asname or a.name)
      elif isinstance(node, ast.Import):
        aliases |= {a.asname for a in node.names if a.name.startswith("jspec") and a.asname}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        wrong.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_layers_name_real_packages(layer):
  for name in LAYERS[layer]:
    assert importlib.util.find_spec(name) is not None, name
