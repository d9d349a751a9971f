"""A checkpoint's small JSON files, read with errors that name the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(file: Path, missing_ok: bool = False) -> dict:
  """The JSON object in `file` ({} for a missing file when `missing_ok`)."""
  if missing_ok and not file.is_file():
    return {}
  try:
    data = json.loads(file.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file} is not valid JSON ({e}). Fix: restore the file from the "
                     f"checkpoint") from None
  if not isinstance(data, dict):
    raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object. Fix: restore the "
                     f"file from the checkpoint")
  return data
