"""Counting XLA compilations and machine facts for benchmarks."""

from __future__ import annotations

import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_active: list["CompileCounter"] = []
_registered = False


def _listener(name: str, duration: float, **_) -> None:
  for counter in _active:
    if name.startswith("/jax/core/compile/"):
      counter.seconds += duration
    if name == _BACKEND_COMPILE:
      counter.compiles += 1


class CompileCounter:
  """Context manager counting backend compilations (and their seconds) inside its block."""

  def __init__(self):
    self.compiles = 0
    self.seconds = 0.0

  def __enter__(self) -> "CompileCounter":
    global _registered
    if not _registered:
      jax.monitoring.register_event_duration_secs_listener(_listener)
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


def memory_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> dict:
  """Best-of-`repeats` GB/s for a streaming copy (bytes read + written) and a streaming read.

  The copy is `y = x + 1` under jit (XLA cannot elide it) on the default device; the read is a
  sum. The larger of the two is the bandwidth the decode fraction is measured against.
  """
  x = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  read = jax.jit(lambda a: jnp.sum(a))
  results = {}
  for name, fn, moved in (("copy_gbps", copy, 2 * nbytes), ("read_gbps", read, nbytes)):
    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(x))
      best = min(best, time.perf_counter() - start)
    results[name] = moved / best / 1e9
  src, dst = np.ones(nbytes // 8), np.empty(nbytes // 8)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - start)
  results["numpy_copy_gbps"] = 2 * src.nbytes / best / 1e9
  results["bandwidth_gbps"] = max(results.values())
  return results
