"""JAX's persistent compilation cache, kept under the jspec cache directory so that a second run
of the same command loads its XLA programs instead of compiling them.

The CLI turns it on for every command; library code calls `enable()` itself (it sets process-wide
JAX options, which a library should not do on import). `JSPEC_COMPILATION_CACHE` = a directory
moves it, = "off" disables it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jspec.io.fetch import cache_dir

ENV = "JSPEC_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "none")


def enable(directory: str | Path | None = None) -> Path | None:
  """Cache every compiled program in `directory` (default: $JSPEC_COMPILATION_CACHE, else
  <jspec cache>/xla). Returns the directory, or None when $JSPEC_COMPILATION_CACHE is "off"."""
  setting = os.environ.get(ENV, "")
  if directory is None and setting.lower() in _OFF and setting:
    return None
  path = Path(directory or setting or cache_dir() / "xla").expanduser()
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  # jspec's programs are worth keeping however fast they compiled: a decode loop is one program,
  # and loading a model compiles one small dequantization program per tensor layout.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
