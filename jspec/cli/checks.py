"""Every check the arguments allow without a model, run before anything loads or is fetched."""

from __future__ import annotations

import sys
from pathlib import Path

from jspec.cli.options import (DATA_DEFAULTS, NETWORK_FLAGS, confu_setting, flag_of, sampling_of,
                               unescaped)
from jspec.io.datastore import MAX_ORDER


# Arguments that must be at least this (checked before anything loads).
_AT_LEAST = {"max_new_tokens": 1, "num_prompts": 1, "gamma": 1, "seq_len": 2, "batch_size": 1,
             "gen_batch_size": 1, "grad_accum": 1, "steps": 0, "rounds": 1, "stride": 1,
             "batch": 1, "size": 1, "top_k": 0, "num_samples": 1, "context": 1, "repeats": 1,
             "layers": 1, "eval_every": 1, "checkpoint_every": 1, "ttt_steps": 1,
             "n_max": 1, "min_count": 1, "block_s": 1, "block_k": 1, "part": 1, "warmup": 0,
             "warmup_steps": 0, "prompt_offset": 0, "hidden_size": 1, "anchors": 1,
             "experts": 1, "expert_top_k": 1, "soft_tokens": 0, "vocab_trim": 0, "chunk": 1,
             "kv_budget": 1, "kv_chunk": 1, "kv_sinks": 0, "kv_window": 0, "kv_evict_every": 1}


# --kv-* settings of an evicting cache: they need --kv-budget.
_KV_SETTINGS = ("kv_policy", "kv_chunk", "kv_sinks", "kv_window", "kv_evict_every",
                "kv_drafter")


def _check_drafter_args(args) -> None:
  """Flags that only a speculative run reads, refused where nothing would read them (a silently
  ignored setting reads as a measured one)."""
  from jspec.drafting.registry import parse_drafter
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
  named = [parsed for name in args.drafter.split(",") if (parsed := parse_drafter(name))]
  kinds = [kind for parsed in named for kind in parsed.kinds]
  unread = lambda flag, what: ValueError(
      f"{flag} sets {what}; --drafter {args.drafter} does not read it, so it would be ignored. "
      f"Fix: drop {flag}, or draft with such a model")
  if args.drafter_weights is not None and not any(kind.reads_dtype for kind in kinds):
    raise unread("--drafter-weights", "the draft model's weights (default, model:PATH; `self` "
                                      "drafts with the target's own)")
  if getattr(args, "kv_drafter", None) is not None and not any(k.draft_model for k in kinds):
    raise unread("--kv-drafter", "a draft model's own cache (default, self, early-exit:K, "
                                 "model:PATH)")
  if gamma == "auto" and (not any(kind.draft_model for kind in kinds) or args.tree):
    raise ValueError("--gamma auto picks a chain length for a model drafter: it needs a model "
                     "drafter (default, self, early-exit:K, model:PATH) and no --tree. Fix: "
                     "--gamma N (a number)")
  if gamma is not None and named and all(any(k.own_tree for k in p.kinds) for p in named):
    raise ValueError(f"--gamma sets a chain's length; --drafter {args.drafter} verifies a tree of "
                     f"its own each round (lookahead's n-gram pool), so it would be ignored. Fix: "
                     f"drop --gamma")
  if args.tree and any(parsed.stop is not None for parsed in named):
    raise ValueError("a drafter name ending in @P (adaptive draft length) stops chains only; a "
                     "tree grows to its shape, so it would be ignored. Fix: drop @P, or drop "
                     "--tree")
  if args.command == "bench-tau" and any(kind.own_tree for kind in kinds):
    raise ValueError(f"bench-tau scores rounds from a prefill, where --drafter {args.drafter}'s "
                     f"n-gram pool is still empty (tau exactly 1). Fix: measure it with jspec "
                     f"bench")
  if args.tree and any(kind.chains_only for kind in kinds):
    raise ValueError("layer-skip drafts (--drafter skip:N) draft chains only. Fix: drop --tree "
                     "(--gamma N sets the chain)")
  if args.command == "generate" and args.tree and gamma is not None:
    raise ValueError(f"--gamma sets a chain's length and --tree {args.tree} a tree's shape: one "
                     f"round drafts one of them. Fix: drop --gamma (or --tree)")
  if isinstance(gamma, int) and gamma > args.max_new_tokens:
    raise ValueError(f"--gamma {gamma} drafts more tokens a round than --max-new-tokens "
                     f"{args.max_new_tokens} can take (each round verifies gamma + 1 positions). "
                     f"Fix: --gamma <= {args.max_new_tokens}")


def _check_draft_penalties(args) -> None:
  """--draft-penalties / --no-draft-penalties: refused where no drafter would read them."""
  from jspec.drafting.registry import parse_drafter
  setting = getattr(args, "draft_penalties", None)
  if setting is None:
    return
  flag = "--draft-penalties" if setting else "--no-draft-penalties"
  names = [name for name in args.drafter.split(",") if name != "none"]
  if not names:
    raise ValueError(f"{flag} sets how a drafter drafts, but no drafter is given. Fix: add "
                     f"--drafter NAME, or drop it")
  if not sampling_of(args).penalized:  # (a host bool: the settings' static mode)
    raise ValueError(f"{flag} sets whether drafts are drawn under the run's penalties, and the run "
                     f"has none, so it would change nothing. Fix: drop {flag}, or set "
                     f"--repetition-penalty, --presence-penalty or --frequency-penalty")
  if not any(kind.draws_logits for name in names for kind in parse_drafter(name).kinds):
    raise ValueError(f"{flag}: --drafter {args.drafter} drafts from a lookup (a table, not "
                     f"logits), so no penalty applies to its drafts. Fix: drop {flag}, or give "
                     f"the lookup a model behind it (e.g. ngram+default)")


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
    given = [flag_of(name) for name in DATA_DEFAULTS if getattr(args, name) is not None]
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
      raise ValueError(f"{flag_of(name)} must be a finite number >= 0, got {value}")
  decay = getattr(args, "ttt_decay", None)
  if decay is not None and not 0 < decay <= 1:
    raise ValueError(f"--ttt-decay must be in (0, 1], got {decay}")
  if getattr(args, "command", None) == "train-eagle":
    steps, warmup = args.steps, args.warmup_steps
    if args.network == "confu":
      top_k, experts = confu_setting(args, "expert_top_k"), confu_setting(args, "experts")
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
  named = {("--drafters" if name == "drafter" else flag_of(name)):
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
    ignored = [flag_of(name) for name, (networks, _) in NETWORK_FLAGS.items()
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
  for flag in ("out", "json", "plot"):
    path = getattr(args, flag, None)
    if path is not None:
      _check_writable(f"--{flag}", Path(path), is_dir=flag == "out" and args.command in _OUT_DIRS)


def _check_writable(flag: str, path: Path, is_dir: bool) -> None:
  """A file (or a directory to fill) can be made at `path`: a file is written and removed in the
  nearest directory that exists (os.access says yes to root on read-only places such as /proc)."""
  import tempfile
  start = path.absolute() if is_dir else path.absolute().parent
  while not start.exists():
    start = start.parent
  try:
    with tempfile.TemporaryFile(dir=start):
      pass
  except OSError as e:
    raise ValueError(f"{flag} {path}: nothing can be written in {start} ({e.strerror}), so the "
                     f"run's results would be lost at its end. Fix: a path in a writable "
                     f"directory") from None


def check_args(args) -> None:
  """Every check a command's arguments allow without a model, run before anything loads or is
  fetched: a typo fails in a second with the flag named, not after a model load."""
  from jspec.drafting.registry import parse_drafter
  from jspec.io.load import check_source
  from jspec.tree.shapes import parse_trees

  for name, least in _AT_LEAST.items():
    value = getattr(args, name, None)
    if isinstance(value, int) and not isinstance(value, bool) and value < least:
      raise ValueError(f"{flag_of(name)} must be at least {least}, got {value}")
  if hasattr(args, "kv_budget") and args.kv_budget is None:
    given = [flag_of(name) for name in _KV_SETTINGS if getattr(args, name, None) is not None]
    if given:
      raise ValueError(f"{', '.join(given)} set(s) how a KV budget evicts, but no --kv-budget is "
                       f"given (the cache holds every token). Fix: add --kv-budget N (entries "
                       f"kept per row), or drop them")
  kv_chunk, kv_budget = getattr(args, "kv_chunk", None), getattr(args, "kv_budget", None)
  if kv_chunk is not None and kv_budget is not None and kv_chunk > kv_budget:
    raise ValueError(f"--kv-chunk {kv_chunk} is larger than --kv-budget {kv_budget}: prefill "
                     f"evicts down to the budget after each chunk. Fix: --kv-chunk <= {kv_budget}")
  if args.command == "bench-tau" and args.drafter == "none":
    raise ValueError("bench-tau needs a drafter to draft the trees: --drafter default|model:PATH|"
                     "self|early-exit:K")
  if args.command in ("generate", "bench", "bench-tau"):
    _check_drafter_args(args)
  if args.command == "score":
    if not args.text and not args.file:
      raise ValueError("score needs something to score: --text TEXT or --file PATH")
    for path in args.file:
      if not path.is_file():
        raise FileNotFoundError(f"--file {path}: no such file")
  if getattr(args, "stop", None):
    from jspec.streaming import check_stop
    try:
      check_stop(unescaped(args.stop))
    except ValueError:
      raise ValueError("--stop is empty: give the text that ends an answer") from None
  if getattr(args, "stream", False) and len(args.prompt) > 1:
    raise ValueError(f"--stream prints one prompt's text as it comes; {len(args.prompt)} "
                     f"--prompt were given. Fix: one --prompt, or drop --stream")
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
  _check_draft_penalties(args)
  _check_data_args(args)
  _check_output_paths(args)
  if hasattr(args, "temperature"):
    import numpy as np
    sampling = sampling_of(args)
    if getattr(args, "gamma", None) == "auto" and sampling.settings_per_row:
      raise ValueError("--gamma auto calibrates under one setting, got sampling settings per "
                       "--prompt. Fix: --gamma N (a number)")
    greedy = np.asarray(sampling.temperature) == 0
    filters = ((np.asarray(sampling.top_k) > 0) | (np.asarray(sampling.top_p) < 1)
               | (np.asarray(sampling.min_p) > 0))
    if np.any(greedy & filters):
      print("[jspec] note: --top-k, --top-p and --min-p filter sampled tokens; at --temperature 0 "
            "(greedy, the default) they change nothing", file=sys.stderr)
  if getattr(args, "n_max", None) is not None and args.n_max > MAX_ORDER:
    raise ValueError(f"--n-max must be at most {MAX_ORDER}, got {args.n_max}")
  if args.command == "build-datastore":
    _check_datastore_args(args)


def _check_datastore_args(args) -> None:
  """Sources that exist, each once (a corpus given twice counts its contexts twice: --min-count
  8 would keep what 4 keeps), and an --out unless the default datastore is what is built."""
  from jspec.io.datastore import MIN_COUNT, N_MAX
  seen = set()
  for source in args.sources or ():
    if source != "sharegpt" and not Path(source).exists():
      raise FileNotFoundError(f"--from {source}: no such file or directory. Fix: 'sharegpt', a "
                              f"directory of `jspec distill-data` or a text file")
    key = source if source == "sharegpt" else Path(source).resolve()
    if key in seen:
      raise ValueError(f"--from {source} is given twice: its contexts would count twice. Fix: "
                       f"give each source once")
    seen.add(key)
  default = (args.sources or ["sharegpt"]) == ["sharegpt"] and (args.n_max, args.min_count) == (
      N_MAX, MIN_COUNT)
  if args.out is None and not default:
    raise ValueError(f"without --out, build-datastore writes the default datastore that "
                     f"--drafter rest reads: ShareGPT alone with --n-max {N_MAX} --min-count "
                     f"{MIN_COUNT}. Fix: --out FILE for this one, then --drafter rest:FILE")
