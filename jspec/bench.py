"""`jspec bench`: decoding speed on real prompts, jspec beside a reference in the same run.

Every method decodes the same prompts at batch 1 on the same machine in one process; records go to
a JSON file (one record per method) and a table on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jspec.generate import generate, prompt_bucket
from jspec.model import Model
from jspec.models.llama import param_bytes
from jspec.profiling import CompileCounter, machine_info, memory_bandwidth
from jspec.sampling.processing import SamplingParams


@dataclasses.dataclass
class Run:
  """Per-prompt measurements of one method."""

  new_tokens: list[int] = dataclasses.field(default_factory=list)
  wall_s: list[float] = dataclasses.field(default_factory=list)
  ttft_s: list[float] = dataclasses.field(default_factory=list)
  target_calls: list[int] = dataclasses.field(default_factory=list)
  outputs: list[list[int]] = dataclasses.field(default_factory=list)

  def summary(self) -> dict:
    wall, toks = sum(self.wall_s), sum(self.new_tokens)
    decode_s = sum(w - t for w, t in zip(self.wall_s, self.ttft_s))
    decode_toks = sum(n - 1 for n in self.new_tokens)
    return {
        "n_prompts": len(self.wall_s),
        "new_tokens": toks,
        "target_calls": sum(self.target_calls),
        "tokens_per_s": toks / wall,
        # Decode rate excludes each prompt's time to first token (timed in a separate call).
        "decode_tokens_per_s": decode_toks / decode_s if decode_s > 0 and decode_toks else None,
        "wall_s": wall,
        "ttft_s": statistics.mean(self.ttft_s),
    }


def _timed(fn):
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def bench_jspec(model: Model, prompts: Sequence[list[int]], max_new_tokens: int,
                sampling: SamplingParams, seed: int) -> tuple[Run, dict]:
  """Autoregressive jspec: warm up every bucket (compile timed apart), then time each prompt."""
  stop = model.tokenizer.stop_token_ids
  gen = lambda p, n: generate(model.params, model.cfg, [p], max_new_tokens=n, sampling=sampling,
                              key=seed, stop_ids=stop)
  compile_s, warm_s = [], []
  seen = set()
  for p in prompts:
    bucket = prompt_bucket(len(p))
    if bucket in seen:
      continue
    seen.add(bucket)
    with CompileCounter() as counter:
      _, first = _timed(lambda: gen(p, max_new_tokens))
      _timed(lambda: gen(p, 1))
    compile_s.append(counter.seconds)
    warm_s.append(first)
  run = Run()
  for p in tqdm(prompts, desc="jspec autoregressive", leave=False):
    _, ttft = _timed(lambda: gen(p, 1))
    out, wall = _timed(lambda: gen(p, max_new_tokens))
    run.ttft_s.append(ttft)
    run.wall_s.append(wall)
    run.new_tokens.append(int(out.lengths[0]))
    run.target_calls.append(int(out.target_calls))
    run.outputs.append(out.sequences()[0])
  extra = {"compile_s": statistics.mean(compile_s), "compile_s_total": sum(compile_s),
           "programs": 2 * len(seen)}
  return run, extra


def bench_transformers(model: Model, prompts: Sequence[list[int]], max_new_tokens: int,
                       sampling: SamplingParams, seed: int) -> tuple[Run, dict]:
  """transformers' `generate` on the same weights (GGUF dequantized to float32 by transformers)."""
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count() or 1)
  src = Path(model.source)
  if src.suffix == ".gguf":
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                              dtype=torch.float32)
  else:
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
  hf.eval()
  stop = list(model.tokenizer.stop_token_ids)
  temperature = float(sampling.temperature)
  kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=stop[0],
                top_k=None, top_p=None, temperature=None, do_sample=False)
  if temperature > 0:
    kwargs.update(do_sample=True, temperature=temperature, top_k=int(sampling.top_k) or None,
                  top_p=float(sampling.top_p))
  torch.manual_seed(seed)

  def gen(p, n):
    with torch.no_grad():
      ids = torch.tensor([p])
      return hf.generate(ids, attention_mask=torch.ones_like(ids), **{**kwargs, "max_new_tokens": n})

  gen(prompts[0], 4)  # warm-up
  run = Run()
  for p in tqdm(prompts, desc="transformers", leave=False):
    start = time.perf_counter()
    gen(p, 1)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = gen(p, max_new_tokens)[0, len(p):].tolist()
    run.wall_s.append(time.perf_counter() - start)
    run.ttft_s.append(ttft)
    run.new_tokens.append(len(out))
    run.target_calls.append(len(out))
    run.outputs.append(out)
  return run, {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def run_bench(model: Model, model_name: str, dataset: str, prompts: Sequence[list[int]], *,
              max_new_tokens: int, sampling: SamplingParams, seed: int = 0,
              compare_transformers: bool = True, measure_bandwidth: bool = True) -> list[dict]:
  """Benchmark autoregressive jspec (and transformers) on token-id prompts; returns JSON records."""
  machine = machine_info()
  base = {"model": model_name, "dataset": dataset, "temperature": float(sampling.temperature),
          "top_k": int(sampling.top_k), "top_p": float(sampling.top_p),
          "max_new_tokens": max_new_tokens, "batch": 1, "dtype": str(model.params.embed.dtype),
          "machine": machine}
  records = []
  run, extra = bench_jspec(model, prompts, max_new_tokens, sampling, seed)
  rec = {"method": "jspec-autoregressive", **base, **run.summary(), **extra}
  weights = param_bytes(model.params)
  # Bytes a decode step must read: every weight except the embedding rows not looked up; a tied
  # embedding is read whole as the LM head.
  rec["weight_bytes_per_step"] = weights
  if measure_bandwidth:
    bw = memory_bandwidth()
    rec["bandwidth"] = bw
    if rec["decode_tokens_per_s"]:
      streamed = rec["decode_tokens_per_s"] * weights / 1e9  # GB/s of weights the decode reads
      rec["bandwidth_fraction"] = streamed / bw["bandwidth_gbps"]
      read = max(v for k, v in bw.items() if k.startswith("read_"))
      rec["bandwidth_fraction_vs_read"] = streamed / read
  records.append(rec)
  if compare_transformers:
    hf_run, hf_extra = bench_transformers(model, prompts, max_new_tokens, sampling, seed)
    hf_rec = {"method": "transformers-generate", **base, **hf_run.summary(), **hf_extra}
    if float(sampling.temperature) == 0:
      same = [a == b for a, b in zip(run.outputs, hf_run.outputs)]
      hf_rec["identical_to_jspec"] = sum(same) / len(same)
    rec["speedup_vs_transformers"] = rec["tokens_per_s"] / hf_rec["tokens_per_s"]
    if rec["decode_tokens_per_s"] and hf_rec["decode_tokens_per_s"]:
      rec["decode_speedup_vs_transformers"] = (rec["decode_tokens_per_s"]
                                               / hf_rec["decode_tokens_per_s"])
    records.append(hf_rec)
  return records


def print_table(records: list[dict]) -> None:
  cols = ["method", "dataset", "temperature", "n_prompts", "new_tokens", "tokens_per_s",
          "decode_tokens_per_s", "ttft_s", "wall_s"]
  print(" | ".join(cols))
  for r in records:
    cells = []
    for c in cols:
      v = r.get(c)
      cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
    print(" | ".join(cells))
  for r in records:
    for key in ("speedup_vs_transformers", "decode_speedup_vs_transformers", "bandwidth_fraction",
                "bandwidth_fraction_vs_read", "compile_s", "identical_to_jspec"):
      if key in r:
        print(f"{r['method']}: {key} = {r[key]:.3f}")


def write_records(records: list[dict], path: str | Path) -> Path:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(records, indent=2) + "\n")
  return path
