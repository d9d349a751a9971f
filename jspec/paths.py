"""Where jspec keeps what it fetches and builds: one user cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
  """$JSPEC_CACHE, else $XDG_CACHE_HOME/jspec, else ~/.cache/jspec."""
  if os.environ.get("JSPEC_CACHE"):
    return Path(os.environ["JSPEC_CACHE"]).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "jspec"
