"""`jspec bench-kernel` on CPU: interpreted records are correct and carry no speedup, CPU without
--interpret is refused, and a wrong kernel (zeros, or one that reads the NaN slots) gets no
timing and a failing exit code."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench import kernel as kernel_bench
from jspec.cli import main
from jspec.models import attention

TINY = [kernel_bench.KernelShape("t", B=3, S=128, T=16, H=6, K=2, D=32)]
FAST = {"repeats": 1, "warmup": 0}


def test_inputs_are_ragged_trees_with_nan_past_the_window():
  shape = kernel_bench.KernelShape("s", B=4, S=256, T=8, H=4, K=2, D=32)
  q, k, v, lengths, masks = kernel_bench.make_inputs(shape, jnp.float32)
  assert q.shape == (4, 8, 4, 32) and k.shape == v.shape == (4, 256, 2, 32)
  lengths = np.asarray(lengths)
  assert lengths.min() == 256 // 4 and lengths.max() == 256 - 8 - 1 and len(set(lengths)) == 4
  for b, n in enumerate(lengths):
    assert np.isfinite(np.asarray(k[b, :n + 8])).all() and np.isnan(np.asarray(v[b, n + 8:])).all()
  masks = np.asarray(masks)
  assert masks[:, :, 0].all() and masks[:, np.arange(8), np.arange(8)].all()  # root, self
  assert not np.triu(masks, 1).any()  # ancestors only: parent[i] < i


@pytest.mark.parametrize("backend,block_k", [("gpu", 32), ("tpu", 128)])
def test_interpreted_records(backend, block_k):
  records = kernel_bench.bench_tree_attention(TINY, "float32", interpret=True, backend=backend,
                                              block_k=block_k, **FAST)
  (r,) = records
  assert r["interpret"] is True and r["backend"] == backend
  assert r["platform"] == jax.devices()[0].platform
  assert r["correct"] and r["xla_correct"] and "error" not in r
  assert np.isfinite(r["max_abs_err"]) and r["rel_err"] < 1e-5
  assert r["speedup_vs_reference"] is None and r["speedup_vs_xla"] is None
  assert r["kernel_gbps"] is None
  assert r["kernel_s"] > 0 and r["reference_s"] > 0 and r["xla_s"] > 0
  assert r["machine"]["backend"] == jax.default_backend()


def test_recorded_commands_run_again_as_given():
  """A record's command line, read by a shell, is the argument list that ran (a path with a
  space in it was two arguments)."""
  import shlex
  from jspec.cli.records import command_line, set_command_line
  argv = ["bench", "--json", "my results/k.json", "--prompt", "it's $HOME"]
  set_command_line(argv)
  try:
    assert shlex.split(command_line()) == ["jspec", *argv]
  finally:
    set_command_line(None)


def test_cli_interpret_writes_json(tmp_path, capsys):
  out = tmp_path / "k.json"
  assert main(["bench-kernel", "--small", "--interpret", "--block-k", "32", "--repeats", "1",
               "--warmup", "0", "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  assert [r["name"] for r in records] == [s.name for s in kernel_bench.SMALL_SHAPES]
  for r in records:
    assert r["dtype"] == "bfloat16" and r["correct"] and r["rel_err"] < 2e-2
    assert r["interpret"] is True and r["speedup_vs_reference"] is None
    assert r["command"].startswith("jspec ") and r["timestamp"]
  assert "interpret mode" in capsys.readouterr().out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="only meaningful on a CPU-only host")
@pytest.mark.parametrize("extra", [[], ["--backend", "gpu"], ["--backend", "tpu"]])
def test_cli_refuses_cpu_without_interpret(tmp_path, capsys, extra):
  out = tmp_path / "k.json"
  assert main(["bench-kernel", "--small", "--json", str(out)] + extra) == 2
  err = capsys.readouterr().err
  assert "--interpret" in err and "GPU or TPU" in err
  assert not out.exists()


def test_unknown_shape(capsys):
  assert main(["bench-kernel", "--interpret", "--shapes", "tiny-b2,nope"]) == 2
  assert "nope" in capsys.readouterr().err


def _zeros(q, *args, **kwargs):
  return jnp.zeros_like(q)


def _reads_every_slot(q, k, v, lengths, mask, **kwargs):
  """The model's XLA attention straight on the NaN-poisoned cache: 0 * NaN leaks."""
  return attention.masked_attention(q, k, v, attention.attention_mask(lengths, k.shape[1], mask,
                                                                      q.shape[1]))


@pytest.mark.parametrize("wrong", [_zeros, _reads_every_slot])
def test_wrong_kernel_gets_no_timing(monkeypatch, wrong):
  monkeypatch.setattr(kernel_bench, "tree_attention", wrong)
  (r,) = kernel_bench.bench_tree_attention(TINY, "float32", interpret=True, block_k=32, **FAST)
  assert r["correct"] is False and r["kernel_s"] is None and r["kernel_gbps"] is None
  assert r["speedup_vs_reference"] is None and "kernel output differs" in r["error"]
  assert r["xla_correct"] and r["reference_s"] > 0  # the baselines are still measured


def test_cli_fails_loudly_on_wrong_kernel(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(kernel_bench, "tree_attention", _zeros)
  out = tmp_path / "k.json"
  assert main(["bench-kernel", "--small", "--interpret", "--shapes", "tiny-b2", "--repeats", "1",
               "--warmup", "0", "--json", str(out)]) == 1
  captured = capsys.readouterr()
  assert "WRONG" in captured.out and "timings withheld" in captured.err
  (r,) = json.loads(out.read_text())
  assert r["correct"] is False and r["kernel_s"] is None


def test_key_similarity_cli_interpret_writes_json(tmp_path, capsys):
  out = tmp_path / "ks.json"
  assert main(["bench-kernel", "--kernel", "key-similarity", "--small", "--interpret",
               "--block-s", "32", "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
  (r,) = json.loads(out.read_text())
  assert r["kernel"] == "key-similarity" and r["name"] == "tiny-keys" and r["correct"]
  assert r["rel_err"] < 1e-3 and r["speedup_vs_reference"] is None and r["block_s"] == 32
  assert "tiny-keys" in capsys.readouterr().out


def test_in_program_timing_runs_the_call_once_per_iteration():
  """The loop must run fn every iteration (not once, hoisted), and report seconds per call."""
  calls = []

  def fn(x, n):
    jax.debug.callback(lambda: calls.append(1))
    return x * n

  seconds = kernel_bench.in_program_seconds(fn, (jnp.ones(4), jnp.float32(2)), iters=3, repeats=2)
  assert seconds > 0 and math.isfinite(seconds)
  assert len(calls) == 3 * (3 + 1)  # the warm run and two timed ones, each 1 + iters calls
