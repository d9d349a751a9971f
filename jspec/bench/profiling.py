"""Counting XLA compilations and machine facts for benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_active: list["CompileCounter"] = []
_registered = False


def _listener(name: str, duration: float, fun_name: str = "?", **_) -> None:
  for counter in _active:
    if name.startswith("/jax/core/compile/"):
      counter.seconds += duration
    if name == _BACKEND_COMPILE:
      counter.compiles += 1
      counter.programs.append(fun_name)


def _hit_listener(name: str, **_) -> None:
  if name == _CACHE_HIT:
    for counter in _active:
      counter.cache_hits += 1


class CompileCounter:
  """Context manager counting the XLA programs requested inside its block (`compiles`: built, or
  loaded from JAX's persistent compilation cache, `cache_hits` of them) and their seconds;
  `programs`: their names, as JAX logs them ("jit(decode_segment)")."""

  def __init__(self):
    self.compiles = 0
    self.programs: list[str] = []
    self.cache_hits = 0
    self.seconds = 0.0

  @property
  def built(self) -> int:
    """Programs XLA actually compiled (not loaded from the persistent cache)."""
    return self.compiles - self.cache_hits

  def __enter__(self) -> "CompileCounter":
    global _registered
    if not _registered:
      jax.monitoring.register_event_duration_secs_listener(_listener)
      jax.monitoring.register_event_listener(_hit_listener)
      _registered = True
    _active.append(self)
    return self

  def __exit__(self, *exc) -> None:
    _active.remove(self)


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict:
  """Where a benchmark ran: CPU, cores, JAX backend and devices."""
  devices = jax.devices()
  return {
      "cpu": cpu_name(),
      "cores": os.cpu_count(),
      "platform": platform.platform(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": f"{len(devices)}x {devices[0].device_kind}",
  }


def method_script_parser(doc: str, max_new_tokens: int = 128) -> argparse.ArgumentParser:
  """The arguments the side-by-side benchmark scripts share (benchmarks/streaming.py,
  logprobs.py, stop_strings.py): the model and weights, a prompt set, the token budget, the
  decoding methods (drafter names or "none"), best-of repeats, the output JSON; add your own."""
  ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  ap.add_argument("--model", default="default")
  ap.add_argument("--weights", default="float32")
  ap.add_argument("--dataset", default="mt-bench")
  ap.add_argument("--num-prompts", type=int, default=6)
  ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
  ap.add_argument("--methods", default="none,ngram")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", required=True)
  return ap


def save_script_record(record: dict, path: str | Path) -> None:
  """A benchmark script's record, stamped with the machine and the command line, written as JSON
  and printed (without the machine)."""
  record.update(machine=machine_info(), command=" ".join(["python"] + sys.argv))
  Path(path).write_text(json.dumps(record, indent=1))
  print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=1))


def best_seconds(fn, *args, repeats: int = 1, tries: int = 3) -> float:
  """Best of `tries` timed calls (after one that compiles) of a program running `repeats` times,
  per repeat."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(tries):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best / repeats


def memory_bandwidth(nbytes: int = 1 << 29, repeats: int = 7) -> dict:
  """Best-of-`repeats` GB/s of streaming kernels on the default device, all jitted XLA.

  copy: `x + 1` written in place (donated), bytes read + written, as STREAM counts a copy.
  read: the fastest of a sum and two matrix-vector products (tall and wide) over `nbytes`.
  `bandwidth_gbps` is the largest figure: the most demanding denominator for a decode fraction.
  """
  n = nbytes // 4
  x = jnp.ones((n,), jnp.float32)
  inplace = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  x = jax.block_until_ready(inplace(x))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    x = jax.block_until_ready(inplace(x))
    best = min(best, time.perf_counter() - start)
  results = {"copy_gbps": 2 * nbytes / best / 1e9}
  total = jax.jit(jnp.sum)
  results["read_sum_gbps"] = nbytes / best_seconds(total, x, tries=repeats) / 1e9
  tall = x.reshape(-1, 1024)  # [n / 1024, 1024] @ [1024]
  matvec = jax.jit(lambda w, v: w @ v)
  results["read_matvec_tall_gbps"] = nbytes / best_seconds(
      matvec, tall, jnp.ones((1024,)), tries=repeats) / 1e9
  wide = x.reshape(1024, -1)  # [1024] @ [1024, n / 1024], the LM-head shape
  vecmat = jax.jit(lambda v, w: v @ w)
  results["read_matvec_wide_gbps"] = nbytes / best_seconds(
      vecmat, jnp.ones((1024,)), wide, tries=repeats) / 1e9
  results["bandwidth_gbps"] = max(results.values())
  return results
