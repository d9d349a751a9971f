"""Distillation data: the target's own responses to training prompts, with its top-k log-probs.

The Direct Alignment recipe trains the drafter on what the *target* says (its chat responses), not
on human text, with the target's distribution at every response position as the soft label. One
shard per batch of prompts, written as an .npz of plain arrays (loaded with allow_pickle=False),
so a killed run resumes at the first missing shard and produces the same data.

Shard arrays (R = responses in the shard, T = their tokens in total, K = top_k):
  prompt [sum of prompt lengths] int32, prompt_offsets [R + 1] int64,
  response [T] int32, response_offsets [R + 1] int64,
  top_ids [T, K] int32, top_logprobs [T, K] float16 (log p of top_ids under the target at T=1),
  temperature [] float32 (the sampling temperature of this shard's responses).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jspec.generate import generate
from jspec.io.files import read_json
from jspec.model import Model
from jspec.sampling.processing import SamplingParams

MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  num_prompts: int = 2048
  max_prompt_tokens: int = 192  # longer (templated) prompts are skipped
  max_new_tokens: int = 256
  batch_size: int = 16
  top_k: int = 32
  temperatures: tuple[float, ...] = (0.0, 1.0)  # cycled over shards
  seed: int = 0

  def __post_init__(self):
    for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "batch_size", "top_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"DataConfig {name} must be an integer >= 1, got {value!r}")


def _sha256_lines(lines: Sequence[str]) -> str:
  h = hashlib.sha256()
  for line in lines:
    h.update(line.encode("utf-8") + b"\0")
  return h.hexdigest()


def plan_shards(model: Model, texts: Sequence[str], cfg: DataConfig) -> list[list[list[int]]]:
  """Templated prompts that fit, grouped into batches of similar length (less padding, fewer
  compiled programs), in a seeded order."""
  ids = [model.encode(t, chat=model.tokenizer.chat_template is not None) for t in texts]
  ids = [p for p in ids if 0 < len(p) <= cfg.max_prompt_tokens][: cfg.num_prompts]
  ids.sort(key=len)
  batches = [ids[i: i + cfg.batch_size] for i in range(0, len(ids), cfg.batch_size)]
  order = np.random.default_rng(cfg.seed).permutation(len(batches))
  return [batches[i] for i in order]


def build_dataset(model: Model, texts: Sequence[str], out_dir: str | Path, cfg: DataConfig,
                  progress: bool = True) -> Path:
  """Generate (or finish generating) the distillation set for `texts` into `out_dir`."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  manifest = json.loads(json.dumps({  # as it reads back from JSON (tuples become lists)
      "config": dataclasses.asdict(cfg), "target": model.source,
      "prompts_sha256": _sha256_lines(texts), "num_texts": len(texts),
      "tokenizer_sha256": model.tokenizer.fingerprint}))
  path = out / MANIFEST
  if path.exists():
    old = read_json(path)
    if "tokenizer_sha256" not in old:  # data made before the manifest recorded it
      old["tokenizer_sha256"] = manifest["tokenizer_sha256"]
    if {k: old.get(k) for k in manifest} != manifest:
      raise ValueError(f"{out} holds distillation data made with other settings or prompts; "
                       f"use another directory or delete it")
  shards = plan_shards(model, texts, cfg)
  manifest["num_shards"] = len(shards)
  manifest["num_prompts"] = sum(len(b) for b in shards)
  path.write_text(json.dumps(manifest, indent=2))
  stops = model.tokenizer.stop_token_ids
  done = sum((out / f"shard_{i:05d}.npz").exists() for i in range(len(shards)))
  if done and progress:
    tqdm.write(f"resuming {out}: {done} of {len(shards)} shards already written")
  bar = tqdm(total=len(shards), desc="distillation data", disable=not progress)
  tokens, start = 0, time.perf_counter()
  for i, prompts in enumerate(shards):
    file = out / f"shard_{i:05d}.npz"
    if file.exists():
      bar.update(1)
      continue
    temperature = cfg.temperatures[i % len(cfg.temperatures)]
    res = generate(model.params, model.cfg, prompts, max_new_tokens=cfg.max_new_tokens,
                   sampling=SamplingParams(temperature=temperature),
                   key=jax.random.fold_in(jax.random.key(cfg.seed), i), stop_ids=stops,
                   record_top_k=cfg.top_k)
    lengths = np.asarray(res.lengths)
    out_ids, top_ids, top_lps = (np.asarray(x) for x in (res.tokens, res.top_ids,
                                                         res.top_logprobs))
    rows = range(len(prompts))
    arrays = {
        "prompt": np.concatenate([np.asarray(p, np.int32) for p in prompts]),
        "prompt_offsets": np.cumsum([0] + [len(p) for p in prompts]),
        "response": np.concatenate([out_ids[b, : lengths[b]] for b in rows]),
        "response_offsets": np.cumsum([0] + lengths.tolist()),
        "top_ids": np.concatenate([top_ids[b, : lengths[b]] for b in rows]),
        "top_logprobs": np.concatenate([top_lps[b, : lengths[b]] for b in rows]).astype(np.float16),
        "temperature": np.float32(temperature),
    }
    tmp = out / f".shard_{i:05d}.tmp.npz"
    np.savez(tmp, **arrays)
    tmp.rename(file)  # atomic: a killed run never leaves a half-written shard behind
    tokens += int(lengths.sum())
    bar.update(1)
    bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - start):.0f}")
  bar.close()
  return out


@dataclasses.dataclass
class Example:
  prompt: np.ndarray  # [P] int32
  response: np.ndarray  # [R] int32
  top_ids: np.ndarray  # [R, K] int32
  top_logprobs: np.ndarray  # [R, K] float32


def read_manifest(data_dir: str | Path) -> dict:
  path = Path(data_dir) / MANIFEST
  if not path.is_file():
    raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: not a distillation data directory "
                            f"(make one with `jspec distill-data` or `jspec train-drafter`)")
  return read_json(path)


def iter_examples(data_dir: str | Path, num_shards: int | None = None, start_shard: int = 0
                  ) -> Iterator[Example]:
  """Every (prompt, response, teacher top-k) in shard order, or those of shards
  [start_shard, num_shards) (a generation still under way, or a held-out tail); shards that are
  missing or corrupt raise a clear error."""
  data_dir = Path(data_dir)
  total = read_manifest(data_dir)["num_shards"]
  if num_shards is not None and not 0 < num_shards <= total:
    raise ValueError(f"{data_dir} has {total} shards; cannot read the first {num_shards}")
  stop = total if num_shards is None else num_shards
  if not 0 <= start_shard < stop:
    raise ValueError(f"{data_dir}: start shard {start_shard} is outside [0, {stop})")
  for i in range(start_shard, stop):
    file = data_dir / f"shard_{i:05d}.npz"
    if not file.is_file():
      raise FileNotFoundError(f"{file} is missing: the data generation did not finish; rerun it "
                              f"to resume")
    try:
      with np.load(file, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError) as e:
      raise ValueError(f"{file} is corrupt ({e}); delete it and rerun the data generation") from e
    po, ro = arrays["prompt_offsets"], arrays["response_offsets"]
    for r in range(len(po) - 1):
      yield Example(prompt=arrays["prompt"][po[r]: po[r + 1]],
                    response=arrays["response"][ro[r]: ro[r + 1]],
                    top_ids=arrays["top_ids"][ro[r]: ro[r + 1]],
                    top_logprobs=arrays["top_logprobs"][ro[r]: ro[r + 1]].astype(np.float32))


def complete_shards(data_dir: str | Path) -> int:
  """How many leading shards exist (all of them once the generation finished)."""
  total = read_manifest(data_dir)["num_shards"]
  n = 0
  while n < total and (Path(data_dir) / f"shard_{n:05d}.npz").is_file():
    n += 1
  return n


def token_counts(examples: Iterable[Example], vocab_size: int) -> np.ndarray:
  """How often the target generated each token id [V] (VocabTrim's frequency statistic)."""
  counts = np.zeros(vocab_size, np.int64)
  for ex in examples:
    counts += np.bincount(ex.response, minlength=vocab_size)
  return counts


HELD_OUT = 0.05  # fraction of the distillation examples kept for the tau estimate


def parse_data_dir(spec: str) -> tuple[Path, int, int | None]:
  """"DIR" → (DIR, 0, None): every shard; "DIR:N" → (DIR, 0, N): the first N shards;
  "DIR:A-B" → (DIR, A, B): shards A..B-1 (e.g. a held-out tail)."""
  head, sep, tail = spec.rpartition(":")
  if sep and tail.isdigit():
    return Path(head).expanduser(), 0, int(tail)
  lo, dash, hi = tail.partition("-")
  if sep and dash and lo.isdigit() and hi.isdigit():
    return Path(head).expanduser(), int(lo), int(hi)
  return Path(spec).expanduser(), 0, None


def check_tokenizer(data_dir: str | Path, tokenizer) -> None:
  """Data made with another tokenizer holds other ids for the same text: refused (data made
  before the manifest recorded its tokenizer passes)."""
  made_with = read_manifest(data_dir).get("tokenizer_sha256")
  if made_with is not None and made_with != tokenizer.fingerprint:
    raise ValueError(f"{data_dir} was made by a target with another tokenizer: its token ids "
                     f"mean other text for this model. Fix: --data made by this --model (jspec "
                     f"distill-data --model ...)")


def load_examples(sources: list[tuple[Path, int, int | None]], tokenizer=None
                  ) -> tuple[list, list[dict]]:
  """Examples of every source in order, and a record of what was read (for the metadata);
  with `tokenizer`, sources made with another are refused (`check_tokenizer`)."""
  examples, record = [], []
  for path, start, stop in sources:
    total = read_manifest(path)["num_shards"]  # names a non-data directory clearly
    if tokenizer is not None:
      check_tokenizer(path, tokenizer)
    n = len(examples)
    examples += iter_examples(path, stop, start_shard=start)
    digest = hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    entry = {"dir": str(path), "manifest_sha256": digest, "shards": (stop or total) - start,
             "examples": len(examples) - n}
    if start:
      entry["start_shard"] = start
    record.append(entry)
  return examples, record
