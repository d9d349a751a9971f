"""Notebooks 04-06, run as tests/test_notebooks.py runs 01-03 (a file of their own so that the
suite's workers share the notebooks: pytest-xdist keeps a file on one worker)."""

import re

import pytest

from tests.test_notebooks import run

pytestmark = pytest.mark.slow


def test_04_train_a_drafter():
  text = run("04_train_a_drafter.ipynb")
  m = re.search(r"killed; checkpoints on disk at steps \[([\d, ]+)\] of (\d+)", text)
  assert m, text
  saved, steps = [int(s) for s in m.group(1).split(",")], int(m.group(2))
  assert max(saved) < steps  # killed mid-way
  m = re.search(r"resumed from step (\d+) -> finished at step (\d+)", text)
  assert m and int(m.group(1)) == max(saved) and int(m.group(2)) == steps
  assert "identical to plain decoding: True" in text


def test_05_kv_cache_eviction():
  text = run("05_kv_cache_eviction.ipynb")
  budgeted = set(re.findall(r"keydiff budget \d+: ([\d.]+) MB", text))
  assert len(budgeted) == 1  # the same memory for every prompt length
  full = [float(x) for x in re.findall(r"full cache\s+([\d.]+) MB", text)]
  assert full == sorted(full) and full[-1] > float(budgeted.pop())
  assert re.search(r"a \d+-token prompt in \d+ cache slots", text)
  assert re.search(r"passkey\s+keydiff\s+budget \d+\s+peak KV", text)
  assert "identical to autoregressive under the same budget: True" in text


def test_06_sharding():
  text = run("06_sharding.ipynb")
  assert "greedy       mesh == one device: True" in text
  assert "ngram chain  mesh == one device: True" in text
  assert "does not divide the model's attention heads" in text
  m = re.search(r"'by_op': \{'all-reduce': (\d+)\}", text)
  # Megatron's 2L+1, the exit test, and greedy argmax's two over the vocabulary shards (its max,
  # then the first index holding it: outside any branch since SamplingParams' static mode)
  assert m and int(m.group(1)) == 2 * 30 + 1 + 1 + 2
