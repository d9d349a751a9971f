"""`jspec bench`: decoding speed on real prompts, every method side by side in one run.

jspec autoregressive (the baseline), jspec speculative (with a drafter), transformers' `generate`
and transformers' assisted generation decode the same prompts at batch 1 on the same machine in
one process; records go to a JSON file (one record per method) and a table on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec.bench.profiling import CompileCounter, machine_info, memory_bandwidth
from jspec.bench.round_split import round_split_s
from jspec.decode import plan_cache, prompt_bucket
from jspec.train.features import feature_width
from jspec.drafting.base import Drafter, Features
from jspec.drafting.model import ModelDrafter
from jspec.drafting.registry import has_draft_model
from jspec.io.load import resolve_path
from jspec.kv.policy import KVPolicy
from jspec.model import Model
from jspec.models import quant
from jspec.models.cache import KVCache
from jspec.models.llama import forward, layers_stacked, step_weight_bytes
from jspec.models.numerics import engine_jit, precision_label
from jspec.sampling.processing import GREEDY, SamplingParams, argmax
from jspec.tree.shapes import TreeShape


@dataclasses.dataclass
class Run:
  """Per-prompt measurements of one method."""

  new_tokens: list[int] = dataclasses.field(default_factory=list)
  wall_s: list[float] = dataclasses.field(default_factory=list)
  ttft_s: list[float] = dataclasses.field(default_factory=list)
  target_calls: list[int] = dataclasses.field(default_factory=list)
  outputs: list[list[int]] = dataclasses.field(default_factory=list)
  retimed: int = 0  # timed calls that compiled a program the warm-up missed, timed again
  round_tokens: int = 0  # speculative: tokens emitted by verification rounds
  row_rounds: int = 0  # speculative: verification rounds
  accept_hist: np.ndarray | None = None  # speculative: rounds that accepted k drafts, k = 0..G

  def summary(self) -> dict:
    wall, toks = sum(self.wall_s), sum(self.new_tokens)
    timed_ttft = len(self.ttft_s) == len(self.wall_s)
    decode_s = sum(w - t for w, t in zip(self.wall_s, self.ttft_s)) if timed_ttft else None
    decode_toks = sum(n - 1 for n in self.new_tokens)
    return {
        "n_prompts": len(self.wall_s),
        "new_tokens": toks,
        # None where a method does not report its calls (transformers' assisted generation).
        "target_calls": (sum(self.target_calls) if len(self.target_calls) == len(self.wall_s)
                         else None),
        "tokens_per_s": toks / wall,
        # Decode rate excludes each prompt's time to first token (timed in a separate call, so
        # on short answers it can come out longer than the whole run: no rate then).
        "decode_tokens_per_s": (decode_toks / decode_s if decode_s is not None and decode_s > 0
                                and decode_toks else None),
        "decode_s": decode_s,
        "wall_s": wall,
        "ttft_s": statistics.mean(self.ttft_s) if timed_ttft else None,
        "retimed": self.retimed,
    }


def _timed(fn):
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def _timed_compiled(run: Run, fn):
  """`_timed`, again if the call compiled a program: the warm-up runs one prompt per bucket, and
  a prompt whose text nears max_position_embeddings can get another cache size in the same
  bucket (compile time must not land in a timing)."""
  with CompileCounter() as counter:
    out, seconds = _timed(fn)
  if counter.compiles:
    run.retimed += 1
    out, seconds = _timed(fn)
  return out, seconds


@dataclasses.dataclass
class Method:
  """One way of decoding to time: autoregressive (no drafter), a chain or a tree."""

  model: Model
  max_new_tokens: int
  sampling: SamplingParams
  seed: int
  drafter: Drafter | None = None
  gamma: int = 4
  tree: TreeShape | None = None
  measure_ttft: bool = True
  kv: KVPolicy | None = None  # the target's KV budget
  draft_kv: KVPolicy | None = None  # a model drafter's own (under kv only)

  def generate(self, prompt: list[int], n: int):
    budget = {} if self.kv is None else {
        "kv": self.kv, "draft_kv": self.draft_kv if self.drafter is not None else None}
    return self.model.generate_ids([prompt], max_new_tokens=n, sampling=self.sampling,
                                   key=self.seed, drafter=self.drafter,
                                   gamma=None if self.tree is not None else self.gamma,
                                   tree=self.tree, **budget)

  def warm(self, prompts: Sequence[list[int]]) -> dict:
    """Compile every prompt bucket's programs (timed apart from the runs)."""
    compile_s, compiles, seen = [], 0, set()
    for p in prompts:
      if prompt_bucket(len(p)) in seen:
        continue
      seen.add(prompt_bucket(len(p)))
      with CompileCounter() as counter:
        _timed(lambda: self.generate(p, self.max_new_tokens))
        if self.measure_ttft:
          _timed(lambda: self.generate(p, 1))
      compile_s.append(counter.seconds)
      compiles += counter.compiles
    # programs: the generate programs the timed calls run, one per prompt bucket and call length;
    # compiles: the XLA programs their warm-up requested (built, or loaded from the persistent
    # cache; none for a program this process already holds).
    return {"compile_s": statistics.mean(compile_s), "compile_s_total": sum(compile_s),
            "programs": (2 if self.measure_ttft else 1) * len(seen), "compiles": compiles}

  def time_prompt(self, run: Run, p: list[int]) -> None:
    """One prompt: a 1-token call gives the time to first token (unless not `measure_ttft`: one
    program less to compile per bucket), a full call the wall time."""
    if self.measure_ttft:
      run.ttft_s.append(_timed_compiled(run, lambda: self.generate(p, 1))[1])
    out, wall = _timed_compiled(run, lambda: self.generate(p, self.max_new_tokens))
    run.wall_s.append(wall)
    run.new_tokens.append(int(out.lengths[0]))
    run.target_calls.append(int(out.target_calls))
    run.outputs.append(out.sequences()[0])
    if self.drafter is not None:
      run.round_tokens += int(out.round_tokens)
      run.row_rounds += int(out.row_rounds)
      hist = np.asarray(out.accept_hist)
      run.accept_hist = hist if run.accept_hist is None else run.accept_hist + hist


def bench_interleaved(methods: Sequence[Method], prompts: Sequence[list[int]]
                      ) -> list[tuple[Run, dict]]:
  """Time several methods side by side: all compiled first, then prompt by prompt, each method in
  turn, so a machine that slows down midway slows every method alike and their ratios hold (run
  one method after another and a slowdown lands in the ratio: on a shared VM that once read
  1.72x for what was 1.19x)."""
  extras = []
  for m in methods:  # a line each: compiling them all can take minutes before any timing
    start = time.perf_counter()
    extras.append(m.warm(prompts))
    what = getattr(m, "label", None) or (
        "autoregressive" if m.drafter is None else type(m.drafter).__name__)
    print(f"jspec bench: compiled {what}{' (tree)' if m.tree else ''} in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
  runs = [Run() for _ in methods]
  for p in tqdm(prompts, desc=f"jspec x{len(methods)} methods", leave=False):
    for method, run in zip(methods, runs):
      method.time_prompt(run, p)
  return list(zip(runs, extras))


def round_components_s(model: Model, drafter: Drafter, gamma: int, prompt_len: int = 64,
                       cache_size: int = 512, repeats: int = 16,
                       sampling: SamplingParams = GREEDY) -> tuple[float, float]:
  """Seconds of one round's model work alone, jitted back to back with nothing else: (drafter
  proposal, sampled as in the run, + one target forward of gamma + 1 tokens, that forward alone)."""
  cfg, params = model.cfg, model.params
  lengths = jnp.asarray([prompt_len], jnp.int32)
  prompt = jnp.ones((1, prompt_len), jnp.int32)
  # The state's values do not matter for timing, only its shapes.
  state = drafter.init(prompt, lengths, cache_size, Features(
      hidden=jnp.zeros((1, prompt_len, feature_width(cfg, drafter.feature_layers)),
                       params.embed.dtype), tokens=prompt,
      start=jnp.zeros((1,), jnp.int32)))
  cache = KVCache.init(cfg, 1, cache_size, params.embed.dtype).with_lengths(lengths)
  seq_len = lengths + 1
  positions = (seq_len - 1)[:, None] + jnp.arange(gamma + 1)

  # Weights go in as arguments, as in the engine: closed-over arrays become compile-time constants
  # that XLA lays out for its dot kernels, which made this baseline ~3% faster than any real run.
  @engine_jit
  def rounds(params, drafter, state, cache, key):
    def one(i, carry):
      state, cache, acc = carry
      drafts, q, state = drafter.propose(state, jnp.ones((1, 2), jnp.int32), seq_len,
                                         jax.random.fold_in(key, i), sampling, gamma)
      block = jnp.concatenate([jnp.ones((1, 1), jnp.int32), drafts], axis=1)
      logits, hidden, cache = forward(params, cfg, block, positions, cache,
                                      taps=drafter.feature_layers)
      # The drafter reads the verified block as in a round that accepted all of it.
      state = drafter.update(state, seq_len + gamma + 1,
                             Features(hidden=hidden, tokens=block, start=seq_len - 1))
      # Use every logit (greedy verification takes their argmax), so none of the head is pruned.
      return state, cache, acc + jnp.sum(argmax(logits)) + q[0, 0, 0].astype(jnp.int32)
    return jax.lax.fori_loop(0, repeats, one, (state, cache, jnp.int32(0)))

  @engine_jit
  def verifies(params, cache):
    def one(i, carry):
      cache, acc = carry
      block = jnp.full((1, gamma + 1), i, jnp.int32)
      logits, _, cache = forward(params, cfg, block, positions, cache)
      return cache, acc + jnp.sum(argmax(logits))
    return jax.lax.fori_loop(0, repeats, one, (cache, jnp.int32(0)))

  key = jax.random.key(0)
  best = lambda fn: min(_timed(fn)[1] for _ in range(4)) / repeats  # first call compiles
  return (best(lambda: rounds(params, drafter, state, cache, key)),
          best(lambda: verifies(params, cache)))


def torch_placement(model: Model) -> tuple[str, str]:
  """(torch device, torch dtype name) for transformers beside jspec: the GPU JAX runs on when torch
  sees CUDA (else the CPU: torch has no TPU backend), in jspec's weight dtype (float32 for int8,
  which transformers does not run). torch takes CUDA device 0, JAX's first GPU on a one-GPU
  machine. JAX preallocates 75% of GPU memory: for a large target, run `jspec bench` with
  XLA_PYTHON_CLIENT_PREALLOCATE=false so transformers finds room beside it."""
  import torch
  device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
  dtype = "bfloat16" if model.params.embed.dtype == jnp.bfloat16 else "float32"
  return device, dtype


def _load_transformers(source: str, device: str = "cpu", dtype: str = "float32"):
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count() or 1)
  os.environ["HF_HUB_OFFLINE"] = "1"  # local files only: a path that is not one must fail here
  src = Path(source)
  torch_dtype = getattr(torch, dtype)
  if src.suffix == ".gguf":
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                              dtype=torch_dtype)
  else:
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch_dtype)
  return hf.to(device).eval()


def _dtype_name(hf) -> str:
  """A torch model's dtype as `_load_transformers` takes it: "float32", "bfloat16"."""
  return str(hf.dtype).replace("torch.", "")


@dataclasses.dataclass
class TransformersMethod:
  """transformers' `generate` with `hf` (the target loaded by transformers) as a method
  `bench_interleaved` times beside jspec's, prompt by prompt: `extra_kwargs` pick its cache or
  its assistant (`transformers_method`, `transformers_assisted_method`)."""

  hf: object
  model: Model
  max_new_tokens: int
  sampling: SamplingParams
  seed: int
  extra_kwargs: dict
  label: str
  kwargs: dict = dataclasses.field(init=False, default_factory=dict)  # generate's, set by warm
  drafter = None  # for bench_interleaved's progress lines
  tree = None

  def _kwargs(self) -> dict:
    stop = list(self.model.tokenizer.stop_token_ids)
    kwargs = dict(eos_token_id=stop, pad_token_id=stop[0], top_k=None, top_p=None,
                  temperature=None, do_sample=False, **self.extra_kwargs)
    sampling = self.sampling
    if float(sampling.temperature) > 0:
      kwargs.update(do_sample=True, temperature=float(sampling.temperature),
                    top_k=int(sampling.top_k) or None, top_p=float(sampling.top_p),
                    min_p=float(sampling.min_p) or None)
    if float(sampling.repetition_penalty) != 1:  # transformers has no presence/frequency penalty
      kwargs.update(repetition_penalty=float(sampling.repetition_penalty))
    return kwargs

  def _generate(self, p: list[int], n: int):
    import torch
    with torch.no_grad():
      ids = torch.tensor([p], device=self.hf.device)
      out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             **self.kwargs)
      if self.hf.device.type == "cuda":
        torch.cuda.synchronize()
      return out

  def warm(self, prompts: Sequence[list[int]]) -> dict:
    import torch
    self.kwargs = self._kwargs()
    if self.kwargs.get("cache_implementation") == "static":
      # One cache size for every prompt, and its compiled decode step built before any timing:
      # transformers compiles the static-cache step, and would rebuild it per new cache size.
      longest = max(prompts, key=len)
      self.kwargs["max_cache_len"] = len(longest) + self.max_new_tokens
      for _ in range(2):
        self._generate(longest, self.max_new_tokens)
    else:
      self._generate(prompts[0], 4)  # warm-up
    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "torch_device": str(self.hf.device), "torch_dtype": _dtype_name(self.hf),
            "cache": self.extra_kwargs.get("cache_implementation", "dynamic")}

  def time_prompt(self, run: Run, p: list[int]) -> None:
    import torch
    torch.manual_seed(self.seed)  # each prompt's draws alike however the methods interleave
    start = time.perf_counter()
    self._generate(p, 1)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = self._generate(p, self.max_new_tokens)[0, len(p):].tolist()
    run.wall_s.append(time.perf_counter() - start)
    run.ttft_s.append(ttft)
    run.new_tokens.append(len(out))
    # Plain decoding: one call per token; assisted generation does not report its calls.
    if "assistant_model" not in self.extra_kwargs:
      run.target_calls.append(len(out))
    run.outputs.append(out)


def transformers_method(hf, model: Model, max_new_tokens: int, sampling: SamplingParams,
                        seed: int, cache: str = "dynamic") -> TransformersMethod:
  """transformers' `generate` with `hf` (a GGUF is dequantized by transformers), with its default
  cache or `cache="static"` (a fixed-size cache transformers compiles the forward for)."""
  extra = {} if cache == "dynamic" else {"cache_implementation": cache}
  return TransformersMethod(hf, model, max_new_tokens, sampling, seed, extra,
                            f"transformers ({cache} cache)")


def transformers_assisted_method(hf, model: Model, assistant_source: str | None,
                                 max_new_tokens: int, sampling: SamplingParams, seed: int,
                                 gamma: int) -> TransformersMethod:
  """transformers' assisted generation (`assistant_model=`, constant gamma) on the same pair;
  `assistant_source` None means the target drafts for itself."""
  assistant = hf if assistant_source is None else _load_transformers(
      assistant_source, hf.device, _dtype_name(hf))
  assistant.generation_config.num_assistant_tokens = gamma
  assistant.generation_config.num_assistant_tokens_schedule = "constant"
  return TransformersMethod(hf, model, max_new_tokens, sampling, seed,
                            {"assistant_model": assistant}, "transformers assisted")


def bench_transformers(hf, model: Model, prompts, max_new_tokens, sampling, seed,
                       cache: str = "dynamic") -> tuple[Run, dict]:
  """`transformers_method` timed alone over the prompts."""
  (result,) = bench_interleaved(
      [transformers_method(hf, model, max_new_tokens, sampling, seed, cache)], prompts)
  return result


def _bandwidth_fields(decode_tokens_per_s: float | None, weights: int) -> dict:
  bw = memory_bandwidth()
  fields = {"weight_bytes_per_step": weights, "bandwidth": bw}
  if decode_tokens_per_s:
    streamed = decode_tokens_per_s * weights / 1e9  # GB/s of weights the decode reads
    fields["bandwidth_fraction"] = streamed / bw["bandwidth_gbps"]
    read = max(v for k, v in bw.items() if k.startswith("read_"))
    fields["bandwidth_fraction_vs_read"] = streamed / read
  return fields


def _identical(a: Run, b: Run) -> float:
  return sum(x == y for x, y in zip(a.outputs, b.outputs)) / len(a.outputs)


@dataclasses.dataclass
class NamedDrafter:
  """A drafter to benchmark with its CLI name (see jspec.drafting.registry)."""

  name: str
  drafter: Drafter

  @property
  def transformers_equivalent(self) -> bool:
    """Whether transformers' assisted generation can run the same pair (not for compact jspec
    drafter directories: a borrowed embedding or a VocabTrim head is not an HF model)."""
    from jspec.io.drafter import read_drafter_dir
    if self.name.startswith("model:"):
      path = Path(self.name.split(":", 1)[1]).expanduser()
      return not path.is_dir() or read_drafter_dir(path).kind == "hf"
    return self.name == "self"

  @property
  def assistant_source(self) -> str | None:
    """What transformers loads as the assistant (a local path: named models resolved to their
    fetched files); None: the target itself."""
    if not self.name.startswith("model:"):
      return None
    return str(resolve_path(self.name.split(":", 1)[1]))


def _speculative_fields(run: Run, depth: int, ar_run: Run, ar: dict,
                        sampling: SamplingParams) -> dict:
  """What a chain (depth = gamma) and a tree (depth = its max depth) record alike: τ, the accept
  histogram, time per round and the comparison with the autoregressive run."""
  summary = run.summary()
  fields = {
      "draft_calls_per_round": depth,
      # None where no round ran (one-token answers): tau is >= 1 where it is defined.
      "block_efficiency": run.round_tokens / run.row_rounds if run.row_rounds else None,
      # Before cuts at stop tokens or the token budget: mean accepted drafts + 1.
      "accepted_per_round": (float((run.accept_hist * np.arange(1, depth + 2)).sum()
                                   / run.accept_hist.sum()) if run.accept_hist.sum() else None),
      "accept_hist": run.accept_hist.tolist(),
      "ar_tokens_per_s": ar["tokens_per_s"],
      "speedup_vs_ar": summary["tokens_per_s"] / ar["tokens_per_s"],
      # Per round: decode time without the first token's prefill where it was timed apart.
      "round_s": _decode_or_wall_s(summary) / max(run.row_rounds, 1)}
  if float(sampling.temperature) == 0:
    fields["identical_to_ar"] = _identical(ar_run, run)
  return fields


def _decode_or_wall_s(summary: dict) -> float:
  """The decode time where the first token was timed apart and left a positive rest (a short
  answer's separate 1-token call can take longer than the whole run), else the wall time."""
  decode_s = summary["decode_s"]
  return decode_s if decode_s is not None and decode_s > 0 else summary["wall_s"]


def _tree_record(model: Model, prompts, max_new_tokens: int, sampling: SamplingParams, seed: int,
                 named: NamedDrafter, tree: TreeShape, base: dict, ar_run: Run, ar: dict,
                 chain: dict, gamma: int, measure_ttft: bool = True,
                 kv: KVPolicy | None = None, draft_kv: KVPolicy | None = None) -> dict:
  """One drafter with one token tree: τ, tree size and speed beside its chain and AR records.

  The tree is timed interleaved with its drafter's chain (`bench_interleaved`), so the ratio to
  the chain is side by side; the ratio to AR is that times the chain's own side-by-side ratio."""
  method = lambda tree: Method(model, max_new_tokens, sampling, seed, named.drafter, gamma, tree,
                               measure_ttft, kv, draft_kv)
  (chain_run, _), (run, extra) = bench_interleaved([method(None), method(tree)], prompts)
  record = {"method": "jspec-tree", "drafter": named.name,
            "draft_penalties": bool(named.drafter.draft_penalties), "tree": str(tree),
            "tree_method": tree.method, "tree_nodes": tree.num_nodes + 1,
            "tree_depth": tree.max_depth, **base,
            **({} if kv is None else {"draft_kv": chain.get("draft_kv")}),
            **run.summary(), **extra,
            **_speculative_fields(run, tree.max_depth, ar_run, ar, sampling),
            "chain_tokens_per_s": chain_run.summary()["tokens_per_s"]}
  record["speedup_vs_chain"] = record["tokens_per_s"] / record["chain_tokens_per_s"]
  # Two side-by-side ratios; the direct one compares runs timed apart (drift lands in it).
  record["speedup_vs_ar_direct"] = record["speedup_vs_ar"]
  record["speedup_vs_ar"] = record["speedup_vs_chain"] * chain["speedup_vs_ar"]
  return record


def run_bench(model: Model, model_name: str, dataset: str, prompts: Sequence[list[int]], *,
              max_new_tokens: int, sampling: SamplingParams, seed: int = 0,
              drafters: Sequence[NamedDrafter] = (), gamma: int = 4,
              trees: Sequence[TreeShape] = (), compare_transformers: bool = True,
              measure_bandwidth: bool = True, measure_overhead: bool = True,
              measure_ttft: bool = True, kv: KVPolicy | None = None,
              draft_kv: KVPolicy | None = None) -> list[dict]:
  """Benchmark jspec autoregressive, jspec speculative (each of `drafters`, chain and each of
  `trees`) and transformers (plain, and assisted for drafters it can load) on token-id prompts,
  in one process. Sweeps that want τ and tokens/s only can skip the engine-overhead baseline
  (`measure_overhead`) and the speculative runs' time to first token (`measure_ttft`); the
  autoregressive baseline always times its first token.

  kv: a KV budget for the target in every jspec run, autoregressive included (draft_kv: model
  drafters' own caches), so each speculative run is measured against autoregressive decoding
  under the same policy. transformers has no such cache, and the engine-overhead baseline runs a
  full one: both are left out under a budget."""
  greedy = float(sampling.require_uniform("jspec bench").temperature) == 0
  if kv is not None:
    compare_transformers = measure_overhead = False
  if float(sampling.presence_penalty) or float(sampling.frequency_penalty):
    compare_transformers = False  # transformers' generate has no presence/frequency penalty
  base = {"model": model_name, "dataset": dataset, "temperature": float(sampling.temperature),
          "top_k": int(sampling.top_k), "top_p": float(sampling.top_p),
          "min_p": float(sampling.min_p),
          "repetition_penalty": float(sampling.repetition_penalty),
          "presence_penalty": float(sampling.presence_penalty),
          "frequency_penalty": float(sampling.frequency_penalty),
          "max_new_tokens": max_new_tokens, "batch": 1, "dtype": str(model.params.embed.dtype),
          "mesh": dict(model.mesh.shape) if getattr(model, "mesh", None) is not None else None,
          "weights": quant.format_name(model.params),
          "int8_kernel": quant.int8_kernel(model.params),  # "native", "xla" or None
          # "native": jspec's CPU kernels (float32 or quantized weights), "xla": XLA's dots
          "matmul_kernel": "native" if quant.attention_kernel(model.params) == "native" else "xla",
          # "stacked": one lax.scan over the layers (--scan-layers), else unrolled.
          "layers": "stacked" if layers_stacked(model.params) else "unrolled",
          # "highest" under --precision exact (jspec.models.numerics), else the backend default.
          "matmul_precision": precision_label(),
          "kv": None if kv is None else dataclasses.asdict(kv),
          "machine": machine_info()}
  # Speculative records: the policy model drafters' own caches were given (others have none).
  drafted = lambda name: {} if kv is None else {
      "draft_kv": None if draft_kv is None or not has_draft_model(name)
      else dataclasses.asdict(draft_kv)}
  records = []
  # AR, every chain and transformers' runs timed side by side, prompt by prompt (see
  # bench_interleaved).
  methods = [Method(model, max_new_tokens, sampling, seed, kv=kv)] + [
      Method(model, max_new_tokens, sampling, seed, named.drafter, gamma,
             measure_ttft=measure_ttft, kv=kv, draft_kv=draft_kv) for named in drafters]
  hf_methods = {}
  if compare_transformers:
    device, dtype = torch_placement(model)
    target_hf = _load_transformers(model.source, device, dtype)
    hf_methods["generate"] = transformers_method(target_hf, model, max_new_tokens, sampling,
                                                 seed)
    if device == "cuda":  # on a GPU also its best plain decoding: a static, compiled cache
      hf_methods["static"] = transformers_method(target_hf, model, max_new_tokens, sampling,
                                                 seed, cache="static")
    for i, named in enumerate(drafters):
      if named.transformers_equivalent:
        hf_methods[i] = transformers_assisted_method(target_hf, model, named.assistant_source,
                                                     max_new_tokens, sampling, seed, gamma)
  (ar_run, extra), *runs = bench_interleaved(methods + list(hf_methods.values()), prompts)
  chain_runs = runs[:len(drafters)]
  hf_runs = dict(zip(hf_methods, runs[len(drafters):]))
  ar = {"method": "jspec-autoregressive", "drafter": "none", **base, **ar_run.summary(), **extra}
  if measure_bandwidth:
    ar.update(_bandwidth_fields(ar["decode_tokens_per_s"],
                                step_weight_bytes(model.params, model.cfg.vocab_size)))
  records.append(ar)

  specs = []
  for named, (run, extra) in zip(drafters, chain_runs):
    own = named.drafter.own_tree  # a lookahead pool runs its own tree instead of a chain
    shape = {"gamma": gamma} if own is None else {
        "gamma": None, "tree": str(own), "tree_method": own.method,
        "tree_nodes": own.num_nodes + 1, "tree_depth": own.max_depth,
        "window_tokens": named.drafter.window_size}
    spec = {"method": "jspec-speculative", "drafter": named.name,
            "draft_penalties": bool(named.drafter.draft_penalties), **shape, **base,
            **drafted(named.name),
            **run.summary(), **extra,
            **_speculative_fields(run, gamma if own is None else own.max_depth, ar_run, ar,
                                  sampling)}
    records.append(spec)
    specs.append((named, spec))
  for named, spec in specs:
    for tree in trees if named.drafter.own_tree is None else ():  # lookahead: its own only
      # Each tree is its own program and is not run again: drop the compiled ones. A sweep of
      # ten large trees in one process otherwise ran out of memory maps in LLVM ("Cannot
      # allocate memory" with 20 GB free; vm.max_map_count is 65530 on the machine that hit it).
      jax.clear_caches()
      records.append(_tree_record(model, prompts, max_new_tokens, sampling, seed, named, tree,
                                  base, ar_run, ar, spec, gamma, measure_ttft, kv, draft_kv))
    if trees:
      jax.clear_caches()
    if not (measure_overhead and measure_ttft):
      continue  # the overhead compares decode time per round, prefill timed apart
    d = named.drafter
    if d.probe_masks or d.window_size or d.shares_target_cache or d.stops_early:
      # Their rounds are not "propose gamma, then one (gamma + 1)-token forward": the masks or a
      # lookahead window ride in the verification, the draft runs in the target's cache, or the
      # chain ends early.
      continue
    # Engine overhead: a round's wall time against its model work alone.
    # Baseline at the median prompt's cache size, so attention costs the same in both.
    median = sorted(len(p) for p in prompts)[len(prompts) // 2]
    _, size = plan_cache(model.cfg, [median], max_new_tokens, reserve=gamma + 1)
    spec["round_components_s"], spec["verify_forward_s"] = round_components_s(
        model, named.drafter, gamma, median, size, sampling=sampling.as_arrays())
    # What the loop adds per round beyond drafting and the verification forward: relative to all
    # of the round's model work, and relative to the verification forward alone.
    extra = spec["round_s"] - spec["round_components_s"]
    spec["engine_overhead"] = extra / spec["round_components_s"]
    spec["engine_overhead_vs_verify"] = extra / spec["verify_forward_s"]
    if isinstance(named.drafter, ModelDrafter):  # where the round's time goes, piece by piece
      spec["round_split_s"] = round_split_s(
          model.params, model.cfg, named.drafter, gamma, sampling.as_arrays(),
          context=median, cache_size=size)

  if compare_transformers:
    hf_run, extra = hf_runs["generate"]
    hf = {"method": "transformers-generate", "drafter": "none", **base, **hf_run.summary(),
          **extra}
    if greedy:
      hf["identical_to_jspec"] = _identical(ar_run, hf_run)
    ar["speedup_vs_transformers"] = ar["tokens_per_s"] / hf["tokens_per_s"]
    if ar["decode_tokens_per_s"] and hf["decode_tokens_per_s"]:
      ar["decode_speedup_vs_transformers"] = ar["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
    records.append(hf)
    if "static" in hf_runs:
      st_run, st_extra = hf_runs["static"]
      static = {"method": "transformers-generate-static", "drafter": "none", **base,
                **st_run.summary(), **st_extra}
      if greedy:
        static["identical_to_jspec"] = _identical(ar_run, st_run)
      ar["speedup_vs_transformers_static"] = ar["tokens_per_s"] / static["tokens_per_s"]
      records.append(static)
    for i, (named, spec) in enumerate(specs):
      if i not in hf_runs:
        continue
      as_run, extra = hf_runs[i]
      assisted = {"method": "transformers-assisted", "drafter": named.name, "gamma": gamma,
                  **base, **as_run.summary(), **extra}
      if greedy:
        assisted["identical_to_jspec"] = _identical(ar_run, as_run)
      spec["transformers_assisted_tokens_per_s"] = assisted["tokens_per_s"]
      spec["speedup_vs_transformers_assisted"] = spec["tokens_per_s"] / assisted["tokens_per_s"]
      records.append(assisted)
  return records


SUMMARY_KEYS = ("speedup_vs_transformers", "speedup_vs_transformers_static",
                "decode_speedup_vs_transformers", "bandwidth_fraction",
                "bandwidth_fraction_vs_read", "compile_s", "identical_to_jspec", "block_efficiency",
                "accepted_per_round",
                "speedup_vs_ar", "identical_to_ar", "engine_overhead", "engine_overhead_vs_verify",
                "speedup_vs_transformers_assisted", "speedup_vs_chain")


def print_table(records: list[dict]) -> None:
  cols = ["method", "drafter", "dataset", "temperature", "n_prompts", "new_tokens", "tokens_per_s",
          "decode_tokens_per_s", "ttft_s", "wall_s"]
  if any("tree" in r for r in records):
    cols.insert(2, "tree")
  print(" | ".join(cols))
  for r in records:
    print(" | ".join(f"{r.get(c):.3f}" if isinstance(r.get(c), float) else str(r.get(c))
                     for c in cols))
  for r in records:
    for key in SUMMARY_KEYS:
      if r.get(key) is not None:
        name = r["method"] + (f" {r['tree']}" if "tree" in r else "")
        print(f"{name}: {key} = {r[key]:.3f}")


def write_records(records: list[dict], path: str | Path) -> Path:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(records, indent=2) + "\n")
  return path
