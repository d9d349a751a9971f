"""The target's hidden states on teacher-forced training rows: what a feature-level drafter reads.

A feature drafter (jspec.models.eagle, jspec.drafting.feature) predicts the target's next final
hidden state from its current one and the next token. Training it needs those states at every row
position; computing them costs one target forward per row, so they are computed once and cached as
a float16 .npy next to a small progress file (a killed run resumes at the first missing batch and writes the same array).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec.models.config import Config
from jspec.models.llama import Params, forward_rows

Array = jax.Array


def hidden_states(params: Params, cfg: Config, tokens: Array, taps: tuple[int, ...] = ()) -> Array:
  """[B, S, E] final-normed target hidden states of teacher-forced rows `tokens` [B, S] (the same
  `forward` decoding runs, so training sees the states verification will hand the drafter); with
  `taps`, [B, S, len(taps) E]: the residual stream entering those layers (EAGLE-3)."""
  # One logit row keeps the LM head cheap; only the hidden states are wanted.
  return forward_rows(params, cfg, tokens, jnp.zeros((tokens.shape[0], 1), jnp.int32),
                      taps=taps)[1]


_hidden_jit = jax.jit(hidden_states, static_argnums=(1, 3))


def feature_width(cfg: Config, taps: tuple[int, ...] = ()) -> int:
  """Width of a position's features: the hidden size, or one per tapped layer."""
  return cfg.hidden_size * max(1, len(taps))


def feature_dtype(taps: tuple[int, ...] = ()):
  """float16 for final-normed states; float32 for taps, the raw residual stream, which is
  unbounded (the default model's reaches 22,516, a third of float16's range)."""
  return np.float32 if taps else np.float16


def cached_features(params: Params, cfg: Config, tokens: np.ndarray, path: str | Path,
                    batch_size: int = 8, progress: bool = True,
                    taps: tuple[int, ...] = ()) -> np.ndarray:
  """Target hidden states [N, S, E] float16 of rows `tokens` [N, S] (with `taps`: [N, S,
  len(taps) E] float32, `hidden_states`), computed into `path` (.npy, memory-mapped) batch by batch;
  rerunning resumes. The rows' hash is recorded so a cache made for other rows is refused
  instead of silently reused."""
  path = Path(path)
  N, S = tokens.shape
  E = feature_width(cfg, taps)
  digest = _rows_digest(tokens, cfg, taps)
  meta_file = path.with_suffix(".json")
  meta = json.loads(meta_file.read_text()) if meta_file.exists() and path.exists() else None
  if meta is not None and meta["rows_sha256"] != digest:
    raise ValueError(f"{path} holds the features of other rows (or another target); delete it "
                     f"and {meta_file.name} to recompute")
  if meta is None:
    path.parent.mkdir(parents=True, exist_ok=True)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=feature_dtype(taps), shape=(N, S, E))
    meta = {"rows_sha256": digest, "rows_done": 0, "shape": [N, S, E]}
    meta_file.write_text(json.dumps(meta))
  else:
    out = np.load(path, mmap_mode="r+")
  def saved(done: int) -> None:
    out.flush()
    meta["rows_done"] = done
    meta_file.write_text(json.dumps(meta))

  _fill(params, cfg, tokens, out, meta["rows_done"], batch_size, progress, saved, taps)
  return np.load(path, mmap_mode="r")


def features(params: Params, cfg: Config, tokens: np.ndarray, batch_size: int = 8,
             progress: bool = False, taps: tuple[int, ...] = ()) -> np.ndarray:
  """Target hidden states [N, S, E] float16 of rows `tokens` [N, S] (with `taps`: [N, S,
  len(taps) E]), in memory (held-out sets)."""
  out = np.zeros(tokens.shape + (feature_width(cfg, taps),), feature_dtype(taps))
  _fill(params, cfg, tokens, out, 0, batch_size, progress, lambda done: None, taps)
  return out


def _fill(params, cfg, tokens, out, done, batch_size, progress, saved, taps=()) -> None:
  """Rows done.. of `out` from the target, batch by batch (the last batch padded to keep one
  compiled shape); `saved(rows_done)` after each."""
  N = tokens.shape[0]
  bar = tqdm(total=N, initial=done, desc="target features", disable=not progress)
  while done < N:
    idx = np.arange(done, min(done + batch_size, N))
    batch = tokens[np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])]
    out[idx] = np.asarray(_hidden_jit(params, cfg, jnp.asarray(batch), taps))[: len(idx)].astype(
        out.dtype)
    done += len(idx)
    saved(done)
    bar.update(len(idx))
  bar.close()


def _rows_digest(tokens: np.ndarray, cfg: Config, taps: tuple[int, ...] = ()) -> str:
  import hashlib
  h = hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes())
  h.update(repr(cfg).encode())
  if taps:
    h.update(repr(tuple(taps)).encode())
  return h.hexdigest()
