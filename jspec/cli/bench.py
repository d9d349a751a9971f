"""The benchmark commands: `jspec bench` (decoding speed), `bench-kv` (eviction policies on long
contexts), `bench-tau` (paired block efficiency of trees) and `bench-kernel` (Pallas kernels
against their references)."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from jspec.cli.options import (int_list, kv_policies, mesh_of, note_eviction_cadence,
                               penalty_tag, resolve_gamma, sampling_of, with_draft_penalties)
from jspec.cli.records import dataset_prompts, progress, stamp_records


def cmd_bench(args) -> int:
  from jspec.bench import speed
  from jspec.drafting.registry import load_drafter
  from jspec.model import load
  from jspec.speculative.loop import check_extra_positions_target, check_tree_target
  from jspec.tree.shapes import parse_trees

  sampling = sampling_of(args)
  kv, draft_kv = kv_policies(args)  # bad settings fail here, before loading anything
  mesh = mesh_of(args, 1)  # one prompt at a time: tp (or a dp of 1)
  if mesh is not None and mesh.shape["dp"] > 1:
    raise ValueError(f"jspec bench runs one prompt at a time, which cannot split over --mesh "
                     f"dp={mesh.shape['dp']}. Fix: --mesh tp=N (or measure dp with "
                     f"benchmarks/sharding.py)")
  start = time.perf_counter()
  model = load(args.model, args.dtype, mesh=mesh, scan_layers=args.scan_layers)
  progress(f"loaded the target in {time.perf_counter() - start:.1f} s")
  drafter_weights = args.drafter_weights or args.dtype
  drafters = []
  for name in args.drafter.split(","):
    if name != "none":  # a line each: calibrating a drafter (skip:N) runs the target
      start = time.perf_counter()
      drafter = with_draft_penalties(args, name, load_drafter(name, model, drafter_weights))
      drafters.append(speed.NamedDrafter(name, drafter))
      progress(f"built drafter {name} in {time.perf_counter() - start:.1f} s")
  trees = [t for text in args.tree or () for t in parse_trees(text)]
  if trees and not drafters:
    raise ValueError("--tree needs a drafter to draft the trees: add --drafters model:PATH (or "
                     "self, early-exit:K)")
  prompts = dataset_prompts(model, args.dataset, args.num_prompts)
  if trees or any(d.drafter.own_tree is not None for d in drafters):  # before any run
    check_tree_target(model.params)  # an int8-xla target cannot verify trees
  for d in drafters:  # nor run probe masks or windows beside its verification block
    check_extra_positions_target(model.params, d.drafter)
  gamma, choice = resolve_gamma(args, model, [d.drafter for d in drafters], prompts[0], sampling,
                                kv=kv, draft_kv=draft_kv)
  if drafters:
    note_eviction_cadence(kv, max([gamma] + [t.max_depth for t in trees]
                                  + [d.drafter.own_tree.max_depth for d in drafters
                                     if d.drafter.own_tree is not None]))
  if kv is not None and not (args.no_transformers and args.no_overhead):
    progress("under --kv-budget every jspec run evicts; transformers (no such cache) and the "
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
  if choice is not None:
    attach_gamma_auto(records, gamma, choice)
  stamp = stamp_records(records)
  # File tag per drafter: "self", "early-exit-4", "model-<directory name>".
  tag = "+".join(d.name.split(":")[0] + ("-" + Path(d.name.split(":", 1)[1]).name
                                         if ":" in d.name else "") for d in drafters) or "ar"
  tag += "+trees" if trees else ""
  tag += f"_kv{kv.budget}-{kv.method}" if kv is not None else ""
  tag += penalty_tag(args)
  out = args.json or Path("benchmarks") / f"{tag}_{args.dataset}_t{args.temperature:g}_{stamp}.json"
  speed.print_table(records)
  print(f"wrote {speed.write_records(records, out)}")
  return 0


def cmd_bench_kv(args) -> int:
  from jspec.bench import kv as bench_kv, speed
  from jspec.bench.profiling import machine_info
  from jspec.model import load
  from jspec.models.llama import layers_stacked
  from jspec.data import sharegpt_conversations

  setup = bench_kv.BenchKV(  # bad settings fail here, before loading anything
      methods=args.methods.split(","), budgets=int_list("--budgets", args.budgets, least=1),
      context=args.context, tasks=args.tasks.split(","), num_samples=args.num_samples,
      time_decode=not args.no_timing, decode_tokens=args.decode_tokens,
      chunk=args.chunk, sinks=args.sinks, window=args.window, evict_every=args.evict_every,
      continuation=args.continuation, seed=args.seed)
  model = load(args.model, args.dtype, scan_layers=args.scan_layers)
  out = args.json or Path("benchmarks") / f"kv_{args.context}_{stamp_records([])}.json"
  machine, done = machine_info(), []

  def save(record):  # every record as it comes, so an interrupted run keeps what it measured
    record.update(model=model.source, weights=args.dtype,
                  scan_layers=layers_stacked(model.params), machine=machine)
    stamp_records([record])
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
  from jspec.drafting.registry import has_draft_model, load_drafter
  from jspec.model import load
  from jspec.speculative.loop import check_tree_target
  from jspec.tree.shapes import parse_trees

  sampling = sampling_of(args)
  trees = [t for text in args.tree for t in parse_trees(text)]
  kv, draft_kv = kv_policies(args)  # bad settings fail here, before loading anything
  if args.mesh not in (None, "none"):
    raise ValueError("bench-tau scores trees on one device (tau does not depend on the mesh): "
                     "drop --mesh")
  model = load(args.model, args.dtype, scan_layers=args.scan_layers)
  check_tree_target(model.params)
  drafter_weights = args.drafter_weights or args.dtype
  drafter = load_drafter(args.drafter, model, drafter_weights)
  drafter = with_draft_penalties(args, args.drafter, drafter)
  note_eviction_cadence(kv, max(t.max_depth for t in trees))
  prompts = dataset_prompts(model, args.dataset, args.num_prompts)
  responses = paired_tau.target_responses(model, prompts, max_new_tokens=args.max_new_tokens,
                                          sampling=sampling, seed=args.seed)
  contexts = paired_tau.contexts_from_responses(prompts, responses, args.stride)
  result = paired_tau.paired_tau(model.params, model.cfg, drafter, contexts, trees,
                                 sampling=sampling, seed=args.seed, rounds=args.rounds,
                                 batch=args.batch, kv=kv, draft_kv=draft_kv,
                                 stop_ids=model.tokenizer.stop_token_ids,
                                 groups=paired_tau.context_groups(responses, args.stride))
  records = result.records()
  for r in records:
    r.update(kv=None if kv is None else dataclasses.asdict(kv),
             draft_kv=None if draft_kv is None or not has_draft_model(args.drafter)
             else dataclasses.asdict(draft_kv),
             model=args.model, drafter=args.drafter, dataset=args.dataset,
             n_prompts=len(prompts), response_tokens=sum(map(len, responses)),
             stride=args.stride, temperature=args.temperature, top_k=args.top_k,
             top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
             presence_penalty=args.presence_penalty,
             frequency_penalty=args.frequency_penalty,
             draft_penalties=bool(drafter.draft_penalties), seed=args.seed,
             matmul_precision=precision_label(), weights=args.dtype,
             drafter_weights=drafter_weights, max_new_tokens=args.max_new_tokens,
             batch=args.batch)
  stamp = stamp_records(records)
  tag = "" if kv is None else f"_kv{kv.budget}-{kv.method}"
  out = args.json or Path("benchmarks") / (f"paired_tau_{args.dataset}_t{args.temperature:g}"
                                           f"{penalty_tag(args)}"
                                           f"{tag}_{stamp}.json")
  for r in records:
    if r["kind"] == "paired_tau" and r["tau"] is None:
      print(f"{r['tree']:<28} no context starts a round (every first token a stop)")
    elif r["kind"] == "paired_tau":
      print(f"{r['tree']:<28} N={r['num_nodes']:<3} tau {r['tau']:.3f} +- {r['tau_se']:.3f} "
            f"({r['contexts']} contexts x {r['rounds_per_context']} rounds)")
    elif r["tau_a_minus_b"] is not None:
      print(f"  {r['tree_a']} - {r['tree_b']}: {r['tau_a_minus_b']:+.3f} +- {r['se']:.3f} "
            + (f" (z {r['z']:+.1f})" if r["z"] is not None else ""))
  print(f"wrote {speed.write_records(records, out)}")
  return 0


def attach_gamma_auto(records: list[dict], gamma: int, choice) -> None:
  """What --gamma auto measured, kept with the jspec chain records it chose gamma for (not with
  transformers' assisted run at the same gamma, which jspec's calibration did not drive)."""
  for r in records:
    if r["method"] == "jspec-speculative" and r.get("gamma") == gamma and "tree" not in r:
      r["gamma_auto"] = {"rows": list(choice.rows), "accepted_at": list(choice.accepted_at)}


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
  stamp = stamp_records(records)
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
