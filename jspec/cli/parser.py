"""The `jspec` command line: its subcommands and their flags."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from jspec.cli import bench, generate, train
from jspec.cli.options import (PER_PROMPT, TARGET_HELP, WARMUP_HELP, add_data_args,
                               add_gamma_arg, add_kv_args, add_model_args, add_scan_arg,
                               add_target_arg, add_tree_arg, add_weights_arg)
from jspec.drafting.registry import drafter_help
from jspec.io.datastore import MAX_ORDER, MIN_COUNT, N_MAX
from jspec.tree.shapes import TREE_HELP

# The --help description: the first line of jspec/cli/__init__.py's docstring (keep them equal).
DESCRIPTION = "The `jspec` command: generate text and benchmark decoding."


class _DefaultsShown(argparse.HelpFormatter):
  """Each option's default in its help, unless the help already says it or there is none."""

  def _get_help_string(self, action):
    text = action.help or ""
    # "(default ..." or a leading "default:" states it; "default" in prose (the default model,
    # the backend's default) does not.
    if not _has_default(action) or "(default" in text or text.startswith("default:"):
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
  parser = argparse.ArgumentParser(prog="jspec", description=DESCRIPTION,
                                   formatter_class=_DefaultsShown)
  parser.add_argument("--version", action="version", version=f"jspec {_version()}")
  sub = parser.add_subparsers(dest="command", required=True,
                              parser_class=functools.partial(argparse.ArgumentParser,
                                                             formatter_class=_DefaultsShown))
  g = sub.add_parser("generate", help="generate text from prompts")
  add_model_args(g)
  add_gamma_arg(g)
  g.add_argument("--prompt", action="append", required=True,
                 help="prompt text; repeat for a batch" + PER_PROMPT)
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
  add_tree_arg(g)
  add_kv_args(g)
  g.set_defaults(fn=generate.cmd_generate)
  b = sub.add_parser("bench", help="benchmark decoding speed on a prompt set")
  add_model_args(b)
  add_gamma_arg(b)
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
  add_kv_args(b)  # every jspec run under the budget (no transformers run, no overhead baseline)
  b.set_defaults(fn=bench.cmd_bench)
  sc = sub.add_parser("score", help="score text: each text's log-probability and perplexity under "
                                     "the model, with a full cache or under a KV budget")
  add_target_arg(sc)
  add_weights_arg(sc)
  sc.add_argument("--text", action="append", default=[], help="a text to score; repeat for more")
  sc.add_argument("--file", action="append", default=[], type=Path,
                  help="a UTF-8 text file to score as one text; repeat for more")
  sc.add_argument("--chunk", type=int, default=None,
                  help="tokens read at a time (the logits held: chunk x vocabulary a row); "
                       "default 128; under a KV budget, --kv-chunk's")
  add_kv_args(sc, drafter=False)  # score runs no drafter
  sc.set_defaults(fn=generate.cmd_score)
  v = sub.add_parser("bench-kv", help="KV-cache eviction policies on long contexts from real "
                                      "text (passkey, multi-key, variable tracking; KL vs the "
                                      "full cache)")
  add_target_arg(v)
  add_weights_arg(v)
  add_scan_arg(v)
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
                      "entries, snapkv its observation window, the others none; at most (budget - "
                      "sinks) / 2; records before session 46 ran every method with 0)")
  v.add_argument("--continuation", type=int, default=32,
                 help="kl task: teacher-forced tokens scored after the context")
  v.add_argument("--evict-every", type=int, default=1,
                 help="decoding (the answers, the kl continuation): tokens between evictions "
                      "(default 1, per-token eviction as the policies' papers run it and every "
                      "record before session 45; generate's default is 16)")
  v.add_argument("--seed", type=int, default=0)
  v.add_argument("--json", type=Path, default=None)
  v.add_argument("--plot", type=Path, default=None, help="also a PNG of score vs budget")
  v.set_defaults(fn=bench.cmd_bench_kv)
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
  k.set_defaults(fn=bench.cmd_bench_kernel)
  a = sub.add_parser("bench-tau", help="paired block efficiency: every tree scored on the same "
                                       "contexts (the target's own responses), many rounds each")
  add_model_args(a)
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
  # The target (and a model drafter) under the budget; the contexts come from the full-cache
  # target's responses, so runs pair across budgets.
  add_kv_args(a)
  a.set_defaults(fn=bench.cmd_bench_tau)
  t = sub.add_parser("train-drafter", help="distill a draft model from the target's own responses")
  add_target_arg(t, TARGET_HELP)
  t.add_argument("--out", type=Path, required=True,
                 help="output directory: data/, work/ (checkpoints) and drafter/ (the HF model); "
                      "rerunning the same command resumes")
  t.add_argument("--layers", type=int, default=2)
  t.add_argument("--hidden-size", type=int, default=None, help="default: the target's width")
  t.add_argument("--init", choices=["target", "random"], default="target")
  t.add_argument("--loss", choices=["kl", "tvd", "tvd++"], default="tvd++")
  add_data_args(t)
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
  t.add_argument("--warmup-steps", type=int, default=None, help=WARMUP_HELP)
  t.add_argument("--eval-every", type=int, default=100)
  t.add_argument("--checkpoint-every", type=int, default=100)
  t.add_argument("--freeze-embeddings", action="store_true",
                 help="keep the tied embedding/LM head as initialised (from the target)")
  t.add_argument("--seed", type=int, default=0)
  t.set_defaults(fn=train.cmd_train_drafter)
  g = sub.add_parser("train-eagle", help="train a feature-level drafter (EAGLE: one layer over "
                                         "the target's hidden states; EAGLE-3: over three "
                                         "layers', with training-time test) on distillation "
                                         "data")
  add_target_arg(g, TARGET_HELP)
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
  g.add_argument("--warmup-steps", type=int, default=None, help=WARMUP_HELP)
  g.add_argument("--eval-every", type=int, default=100)
  g.add_argument("--checkpoint-every", type=int, default=100)
  g.add_argument("--seed", type=int, default=0)
  g.set_defaults(fn=train.cmd_train_eagle)
  e = sub.add_parser("eval-drafter", help="drafters' acceptance on held-out distillation data "
                                          "(teacher-forced, no decode)")
  add_target_arg(e, TARGET_HELP)
  e.add_argument("--drafters", required=True, help="comma-separated: " + drafter_help())
  e.add_argument("--data", action="append", metavar="DIR[:SHARDS|:A-B]", required=True,
                 help="held-out distillation data (repeatable); :A-B reads shards A..B-1")
  e.add_argument("--seq-len", type=int, default=384)
  e.add_argument("--gamma", type=int, default=3, help="chain length for the tau estimate")
  e.add_argument("--json", type=Path, default=None)
  e.set_defaults(fn=train.cmd_eval_drafter)
  d = sub.add_parser("distill-data", help="generate distillation data: the target's responses to "
                                          "ShareGPT prompts with its top-k log-probs (resumable)")
  add_target_arg(d, TARGET_HELP)
  d.add_argument("--out", type=Path, required=True, help="data directory; rerun to resume")
  add_data_args(d)
  d.add_argument("--prompt-offset", type=int, default=0,
                 help="skip this many prompts of the seeded order: a set of --num-prompts N may "
                      "read up to 2N (prompts too long once templated are skipped), so a disjoint "
                      "next set takes an offset of 2N past the earlier ones")
  d.add_argument("--seed", type=int, default=0)
  d.set_defaults(fn=train.cmd_distill_data)
  v = sub.add_parser("trim-vocab", help="give a drafter a VocabTrim head (the M ids the target "
                                        "generates most)")
  add_target_arg(v, TARGET_HELP)
  v.add_argument("--drafter", required=True,
                 help="the drafter to trim: a drafter directory, a .gguf file or a model name "
                      "(as --model); the trimmed one is written to --out")
  v.add_argument("--data", action="append", metavar="DIR[:SHARDS|:A-B]", default=[],
                 help="distillation data to count generated ids on (repeatable)")
  v.add_argument("--size", type=int, required=True,
                 help="M, ids kept (the full vocabulary size restores an untrimmed head)")
  v.add_argument("--out", type=Path, required=True)
  v.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
  v.set_defaults(fn=train.cmd_trim_vocab)
  s = sub.add_parser("build-datastore", help="build an n-gram datastore for retrieval drafting "
                                             "(--drafter rest:FILE)")
  add_target_arg(s, TARGET_HELP + " (only its tokenizer is read)")
  s.add_argument("--from", dest="sources", action="append", metavar="SOURCE",
                 help="'sharegpt' (default: ShareGPT's answers, conversations overlapping an "
                      "evaluation prompt left out), a directory of `jspec distill-data` (the "
                      "target's own answers) or a UTF-8 text file; repeatable")
  s.add_argument("--out", type=Path, default=None,
                 help="the file to write (default, for ShareGPT alone with the default "
                      "--n-max and --min-count only: where --drafter rest looks for the ShareGPT "
                      "datastore, in the cache)")
  s.add_argument("--n-max", type=int, default=N_MAX,
                 help=f"longest context, in tokens (1-{MAX_ORDER})")
  s.add_argument("--min-count", type=int, default=MIN_COUNT,
                 help="keep contexts seen at least this often")
  s.set_defaults(fn=train.cmd_build_datastore)
  for command in sub.choices.values():  # argparse prints no help line, so no default, without help
    for action in command._actions:
      if action.help is None and _has_default(action):
        action.help = f"default: {action.default}"
  return parser
