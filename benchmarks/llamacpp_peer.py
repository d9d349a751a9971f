"""llama.cpp on jspec's GGUF files and prompts: the CPU peer for the README's speed table.

The CPU build of llama.cpp in the `llama-cpp-cffi` wheel, driven through its raw C API, decodes
the token ids jspec's chat template gives each prompt, greedily by argmax and with no stop tokens
(exactly --max-new-tokens per prompt). Measured, after one warm-up generation:
- load_s: llama_model_load_from_file with llama.cpp's default model params (mmap on);
- per prompt, best (min) of --repeats runs each: prefill_s (prompt processing and the first token)
  and decode_s (the other max_new_tokens - 1 tokens, one llama_decode each); decode_tok_s is
  (max_new_tokens - 1) / decode_s, as jspec.bench.speed counts its decode rate;
- with --draft: greedy speculative decoding on the same API (n_draft tokens drafted one by one,
  verified in one target batch, the longest matching prefix and the target's next token accepted,
  KV caches rolled back; its prefill_s includes the drafter's prefill): the same, tokens per
  target round, and whether its tokens equal greedy's.
  They need not: llama.cpp's logits for a batch differ slightly from one token's, so the two can
  part at a near tie (greedy_logit_gap says how near). With --exact (target n_ubatch 1: one token
  per forward pass) they must be equal: a check of the algorithm, not a speed.

Setup, once (the only network use; it needs `cffi`, nothing else, at run time):
  pip download --no-deps --only-binary=:all: llama-cpp-cffi==0.4.42 -d /tmp/lcc
  pip install --no-deps --target ~/.cache/jspec/llamacpp /tmp/lcc/llama_cpp_cffi-0.4.42-*.whl

  python benchmarks/llamacpp_peer.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
      --json benchmarks/issue17_llamacpp_humaneval_t0_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from jspec.bench.profiling import machine_info
from jspec.data import load_prompts
from jspec.io.load import resolve_path
from jspec.io.tokenizer import Tokenizer


def load_library(site: Path):
  """The wheel's CPU extension module's (lib, ffi), by path, not `import llama` (which imports
  transformers and picks a CUDA or Vulkan build where it finds one). Bound lazily: it wants GCC 14's
  __cxa_call_terminate, which older systems (Debian 12) lack and only a C++ terminate calls."""
  if (so := next((site / "llama").glob("_llama_cpp_cpu.*.so"), None)) is None:
    raise SystemExit(f"no llama.cpp CPU library in {site}/llama: install it (see the docstring)")
  flags = sys.getdlopenflags()
  sys.setdlopenflags(os.RTLD_LAZY)
  try:
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", so)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
  finally:
    sys.setdlopenflags(flags)
  lib, ffi = module.lib, module.ffi
  ffi.def_extern(name="llama_cpp_cffi_ggml_log_callback")(lambda level, text, data: None)
  lib.llama_log_set(lib.llama_cpp_cffi_ggml_log_callback, ffi.NULL)  # quiet
  lib.llama_backend_init()
  return lib, ffi


class Engine:
  """One model with one context (sequence 0); greedy next tokens by argmax of the logits."""

  def __init__(self, lib, ffi, path: Path, n_ctx: int, threads: int, ubatch: int | None = None):
    self.lib, self.ffi = lib, ffi
    start = time.perf_counter()
    self.model = lib.llama_model_load_from_file(str(path).encode(),
                                                lib.llama_model_default_params())
    self.load_s = time.perf_counter() - start
    if self.model == ffi.NULL:
      raise SystemExit(f"llama.cpp could not load {path}")
    self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
    params = lib.llama_context_default_params()
    params.n_ctx = params.n_batch = n_ctx
    params.n_ubatch, params.n_seq_max = ubatch or params.n_ubatch, 1
    params.n_threads = params.n_threads_batch = threads
    self.ctx = lib.llama_init_from_model(self.model, params)
    if self.ctx == ffi.NULL:
      raise SystemExit(f"llama.cpp could not create a context of {n_ctx} tokens")
    self.batch, self.n_past = lib.llama_batch_init(n_ctx, 0, 1), 0

  def truncate(self, n: int):  # keep the first n positions of the KV cache
    self.lib.llama_kv_self_seq_rm(self.ctx, 0, n, -1)  # llama_kv_cache_seq_rm before March 2025
    self.n_past = n

  def eval(self, tokens: list[int], all_logits: bool = False) -> list[int]:
    """Feed tokens at the next positions; the greedy token after the last one, or after each."""
    b, n = self.batch, len(tokens)
    for i, token in enumerate(tokens):
      b.token[i], b.pos[i], b.n_seq_id[i] = token, self.n_past + i, 1
      b.seq_id[i][0] = 0
      b.logits[i] = all_logits or i == n - 1
    b.n_tokens = n
    if (rc := self.lib.llama_decode(self.ctx, b)) != 0:
      raise RuntimeError(f"llama_decode returned {rc}")
    self.n_past += n
    # The first maximum, as llama.cpp's greedy sampler.
    return [int(self.logits(i).argmax()) for i in (range(n) if all_logits else [n - 1])]

  def logits(self, i: int) -> np.ndarray:
    row = self.ffi.buffer(self.lib.llama_get_logits_ith(self.ctx, i), 4 * self.n_vocab)
    return np.frombuffer(row, np.float32)


def greedy(target: Engine, prompt: list[int], n_new: int) -> tuple[list[int], float, float, dict]:
  target.truncate(0)
  start = time.perf_counter()
  out = target.eval(prompt)
  mid = time.perf_counter()
  while len(out) < n_new:
    out += target.eval(out[-1:])
  return out, mid - start, time.perf_counter() - mid, {}


def speculative(target: Engine, draft: Engine, n_draft: int, prompt: list[int],
                n_new: int) -> tuple[list[int], float, float, dict]:
  """Greedy chain speculative decoding. The target's cache holds every token but the last
  (out[-1]); the draft's a prefix of them, which it catches up on at its next draft."""
  target.truncate(0)
  draft.truncate(0)
  start = time.perf_counter()
  out, _ = target.eval(prompt), draft.eval(prompt)
  mid = time.perf_counter()
  rounds = accepted = drafted = 0
  while len(out) < n_new:
    seq = prompt + out
    k = min(n_draft, n_new - len(out) - 1)
    drafts = draft.eval(seq[draft.n_past:]) if k > 0 else []
    while len(drafts) < k:
      drafts += draft.eval(drafts[-1:])
    verdict = target.eval([seq[-1]] + drafts, all_logits=True)
    m = 0
    while m < k and drafts[m] == verdict[m]:
      m += 1
    out += drafts[:m] + [verdict[m]]
    target.truncate(len(seq) + m)
    draft.truncate(min(draft.n_past, len(seq) + m))
    rounds, accepted, drafted = rounds + 1, accepted + m, drafted + k
  stats = {"rounds": rounds, "accepted": accepted, "drafted": drafted}
  return out, mid - start, time.perf_counter() - mid, stats


def measure(run, prompts: list[list[int]], n_new: int, repeats: int) -> dict:
  """A warm-up generation, then each prompt `repeats` times: best prefill and best decode."""
  run(prompts[0], n_new)
  per_prompt = []
  for prompt in prompts:
    results = [run(prompt, n_new) for _ in range(repeats)]
    if any(r[0] != results[0][0] for r in results):
      print("  warning: repeats of one prompt gave different tokens", file=sys.stderr)
    prefill_s, decode_s = min(r[1] for r in results), min(r[2] for r in results)
    per_prompt.append({"prompt_tokens": len(prompt), "prefill_s": prefill_s, "decode_s": decode_s,
                       "decode_tok_s": (n_new - 1) / decode_s, **results[0][3],
                       "tokens": results[0][0]})
  decode_s = sum(r["decode_s"] for r in per_prompt)
  wall_s = decode_s + sum(r["prefill_s"] for r in per_prompt)
  return {"decode_tok_s": len(prompts) * (n_new - 1) / decode_s,
          "tokens_per_s": len(prompts) * n_new / wall_s, "per_prompt": per_prompt}


def compare(spec: dict, ar: dict, target: Engine, prompts: list[list[int]], n_new: int):
  """Speculative tokens against greedy's (where they part, the greedy token's logit lead there, on
  greedy's own path), tokens per verification round (after the prefill's) and acceptance."""
  for r, g, prompt in zip(spec["per_prompt"], ar["per_prompt"], prompts):
    r["matches_greedy"] = r["tokens"] == g["tokens"]
    r["first_mismatch"] = pos = next(
        (i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"])) if a != b), None)
    if pos is not None:
      greedy(target, prompt, pos + 1)  # leaves step pos's logits in the context
      row = target.logits(0 if pos else len(prompt) - 1)
      r["greedy_logit_gap"] = float(row[g["tokens"][pos]] - row[r["tokens"][pos]])
  total = {k: sum(r[k] for r in spec["per_prompt"]) for k in ("rounds", "accepted", "drafted")}
  spec.update({"matches_greedy": all(r["matches_greedy"] for r in spec["per_prompt"]),
               "tokens_per_round": len(prompts) * (n_new - 1) / total["rounds"],
               "acceptance": total["accepted"] / max(1, total["drafted"])})


def show(name: str, res: dict):
  for i, r in enumerate(res["per_prompt"]):
    part = "" if r.get("first_mismatch") is None else (
        f", parts from greedy at token {r['first_mismatch']} (gap {r['greedy_logit_gap']:.3f})")
    print(f"  prompt {i}: {r['prompt_tokens']} tokens, prefill {r['prefill_s']:.3f}s, decode "
          f"{r['decode_tok_s']:.1f} tok/s{part}")
  print(f"{name}: decode {res['decode_tok_s']:.1f} tok/s ({res['tokens_per_s']:.1f} with prefill)")


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen2.5-coder-1.5b", help="jspec model name or GGUF path")
  p.add_argument("--draft", default=None, help="drafter: jspec model name or GGUF path")
  p.add_argument("--n-draft", type=int, default=4)
  p.add_argument("--dataset", default="humaneval", choices=["humaneval", "mt-bench"])
  p.add_argument("--num-prompts", type=int, default=4)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--site", type=Path, default=Path("~/.cache/jspec/llamacpp").expanduser())
  p.add_argument("--exact", action="store_true", help="one token per target forward pass")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  n_new = max(args.max_new_tokens, 2)  # the first token comes with the prefill

  path = resolve_path(args.model)
  tok = Tokenizer.from_gguf(path)
  chats = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
           for text in load_prompts(args.dataset, args.num_prompts)]  # as jspec's Model.encode
  prompts = [tok.encode(chat, add_special_tokens=False) for chat in chats]
  n_ctx = -(-(max(map(len, prompts)) + n_new + args.n_draft + 1) // 256) * 256
  lib, ffi = load_library(args.site)
  target = Engine(lib, ffi, path, n_ctx, args.threads, ubatch=1 if args.exact else None)
  print(f"{path.name}: loaded in {target.load_s:.2f}s, {args.threads} threads, "
        f"{len(prompts)} prompts x {n_new} new tokens")
  ar = measure(lambda pr, n: greedy(target, pr, n), prompts, n_new, args.repeats)
  show("greedy", ar)

  spec = None
  if args.draft:
    draft_path = resolve_path(args.draft)
    draft = Engine(lib, ffi, draft_path, n_ctx, args.threads)
    if draft.n_vocab != target.n_vocab:
      raise SystemExit(f"draft vocabulary {draft.n_vocab} != target's {target.n_vocab}")
    spec = measure(lambda pr, n: speculative(target, draft, args.n_draft, pr, n), prompts, n_new,
                   args.repeats)
    compare(spec, ar, target, prompts, n_new)
    spec.update({"draft": draft_path.name, "draft_load_s": draft.load_s, "n_draft": args.n_draft,
                 "speedup_decode": spec["decode_tok_s"] / ar["decode_tok_s"]})
    show(f"speculative ({draft_path.name}, n_draft {args.n_draft})", spec)
    print(f"  {spec['speedup_decode']:.2f}x greedy, {spec['tokens_per_round']:.2f} tokens/round, "
          f"acceptance {spec['acceptance']:.2f}, same tokens as greedy: {spec['matches_greedy']}")

  if args.json:
    dists = importlib.metadata.distributions(path=[str(args.site)])
    info = ffi.string(lib.llama_print_system_info()).decode().strip()
    record = {"machine": machine_info(),
              "llama_cpp": {"package": {d.metadata["Name"]: d.version for d in dists},
                            "system_info": info, "threads": args.threads},
              "model": path.name, "dataset": args.dataset, "max_new_tokens": n_new,
              "repeats": args.repeats, "exact": args.exact, "load_s": target.load_s,
              "timing": "best of repeats, after one warm-up generation", **ar, "speculative": spec}
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
