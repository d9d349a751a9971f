"""`jspec generate` and `jspec score`: text from prompts, and the log-probability of texts."""

from __future__ import annotations

import math
import sys
import time

from jspec.cli.options import (kv_policies, mesh_of, note_eviction_cadence, resolve_gamma,
                               sampling_of, unescaped, with_draft_penalties)


def cmd_generate(args) -> int:
  import jax
  import numpy as np
  from jspec.bench.profiling import CompileCounter
  from jspec.drafting.registry import load_drafter
  from jspec.model import STOP_EVERY, load
  from jspec.sharding import Placement
  from jspec.streaming import TextStream
  from jspec.tree.shapes import parse_tree

  sampling = sampling_of(args)
  stop = unescaped(args.stop or [])
  kv, draft_kv = kv_policies(args)  # bad settings fail here, before loading anything
  mesh = mesh_of(args, len(args.prompt))
  if mesh is not None:  # before loading anything
    Placement(mesh).check_batch(len(args.prompt))
  start = time.perf_counter()
  model = load(args.model, args.dtype, mesh=mesh, scan_layers=args.scan_layers)
  stop = model.check_stop_strings(stop)  # before the drafter loads
  drafter = load_drafter(args.drafter, model, args.drafter_weights or args.dtype)
  drafter = with_draft_penalties(args, args.drafter, drafter)
  load_s = time.perf_counter() - start
  prompts = args.prompt
  ids = [model.encode(p, chat=args.chat) for p in prompts]
  gamma, _ = resolve_gamma(args, model, [drafter], ids[0], sampling, args.tree, kv, draft_kv)
  if drafter is not None:
    tree = parse_tree(args.tree) if args.tree else drafter.own_tree
    note_eviction_cadence(kv, gamma if tree is None else tree.max_depth)
  # One call; its compile time is counted apart so the speed shown is the run's own.
  start = time.perf_counter()
  run = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, key=args.seed,
             drafter=drafter, gamma=None if args.tree else gamma, tree=args.tree,
             logprobs=args.logprobs,
             **({"kv": kv, "draft_kv": draft_kv if drafter else None} if kv else {}))
  with CompileCounter() as compiled:
    if args.stream or stop:  # --stream: one prompt (check_args), its text as segments come back
      stream = TextStream(model.stream_ids(ids, every=1 if args.stream else STOP_EVERY, **run),
                          model.tokenizer.decode, single=False, stop=stop)
      texts = [""] * len(ids)
      for pieces in stream:
        texts = [text + piece for text, piece in zip(texts, pieces)]
        if args.stream:
          print(pieces[0], end="", flush=True)
      out, stopped = stream.output, stream.stopped
    else:
      out = jax.block_until_ready(model.generate_ids(ids, **run))
      texts = [model.tokenizer.decode(seq) for seq in out.sequences()]
      stopped = [False] * len(ids)
  run_s = max(time.perf_counter() - start - compiled.seconds, 1e-9)
  if args.stream:
    print()
  for prompt, text in zip(prompts, texts) if not args.stream else ():
    if len(prompts) > 1:
      print(f"### {prompt}")
    print(text)
  n = int(out.lengths.sum())
  where = (f" on {dict(model.mesh.shape)} {model.mesh.devices.flat[0].platform} devices"
           if model.mesh is not None else "")
  print(f"[jspec] {model.source}{where}: load {load_s:.1f}s, compile {compiled.seconds:.1f}s "
        f"({compiled.built} XLA programs built, {compiled.cache_hits} loaded from cache), "
        f"{n} tokens in {run_s:.2f}s = {n / run_s:.1f} tokens/s "
        f"({int(out.target_calls)} target calls"
        + ((f", block efficiency {out.block_efficiency:.2f}" if int(out.row_rounds)
            else ", no verification round") + f" with drafter {args.drafter}, "
           + (f"tree {args.tree or drafter.own_tree})"
              if args.tree or drafter.own_tree is not None else f"gamma {gamma})")
           if drafter is not None else ")")
        + ("" if kv is None else f"; KV budget {kv.budget} a row ({kv.method}: sinks {kv.sinks}, "
           f"window {kv.recent}, chunk {kv.chunk}, evict every {kv.evict_every})"),
        file=sys.stderr)
  if args.logprobs:
    rows = zip(out.sequences(), np.asarray(out.logprobs), texts, stopped)
    for i, (seq, lps, text, cut) in enumerate(rows, 1):
      if cut:  # the tokens that make the answer, not those made past its stop string
        seq = seq[:_tokens_covering(model.tokenizer.decode, seq, text)]
      total = float(lps[:len(seq)].sum())
      print(f"[jspec] logprobs ({args.logprobs}) of answer {i}: {len(seq)} tokens"
            + (f", sum {total:.3f}, mean {total / len(seq):.3f} (perplexity "
               f"{math.exp(-total / len(seq)):.3f})" if seq else ""), file=sys.stderr)
  return 0


def _tokens_covering(decode, seq: list[int], text: str) -> int:
  """The fewest of seq's first tokens whose text starts with `text` (a prefix of seq's text)."""
  return next((n for n in range(len(seq) + 1) if decode(seq[:n]).startswith(text)), len(seq))


def cmd_score(args) -> int:
  import numpy as np
  from jspec.model import load

  kv, _ = kv_policies(args)  # bad settings fail here, before loading anything
  texts = list(args.text) + [path.read_text(encoding="utf-8") for path in args.file]
  names = [f"text {i}" for i in range(1, len(args.text) + 1)] + [str(p) for p in args.file]
  model = load(args.model, args.dtype)
  start = time.perf_counter()
  if kv is not None and args.chunk is not None:
    print(f"[jspec] note: under a KV budget the text is read --kv-chunk ({kv.chunk}) tokens at a "
          f"time; --chunk {args.chunk} is not used", file=sys.stderr)
  out = model.score_text(texts, chunk=args.chunk or 128, kv=kv)
  sums, perplexity = out.sums(), out.perplexity()
  seconds = time.perf_counter() - start
  for name, n, total, ppl in zip(names, np.asarray(out.lengths), sums, perplexity):
    print(f"{name}: {int(n)} tokens" + (f", log-probability {total:.3f} (of the {int(n) - 1} "
                                        f"after the first), perplexity {ppl:.3f}" if n > 1 else
                                        " (nothing to score: the first token has no context)"))
  print(f"[jspec] {model.source}: scored {int(np.asarray(out.lengths).sum())} tokens in "
        f"{seconds:.2f}s (compile included)"
        + ("" if kv is None else f"; KV budget {kv.budget} a row ({kv.method}: sinks {kv.sinks}, "
           f"window {kv.recent}, chunk {kv.chunk})"), file=sys.stderr)
  return 0
