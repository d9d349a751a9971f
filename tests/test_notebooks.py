"""The quickstart notebook's code runs top to bottom on the default model."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(capsys):
  cells = json.loads(NOTEBOOK.read_text())["cells"]
  namespace: dict = {}
  for cell in cells:
    if cell["cell_type"] == "code":
      source = "".join(l for l in cell["source"] if not l.lstrip().startswith(("!", "%")))
      exec(compile(source, f"{NOTEBOOK.name}", "exec"), namespace)
  out = capsys.readouterr().out
  assert "Paris" in out
  assert namespace["records"][0]["method"] == "jspec-autoregressive"
  assert namespace["records"][0]["new_tokens"] > 0
