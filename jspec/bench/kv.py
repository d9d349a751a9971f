"""`jspec bench-kv`: KV-cache policies on long contexts built from real text, against the full cache.

Tasks (each context is `context` tokens of ShareGPT conversations, the real text the project
already fetches):
- passkey: a pass key (5 random digits) hidden at a random depth of the haystack, asked for at the
  end; correct when the greedy answer contains it.
- multikey: four keys for four names hidden at random depths (RULER's multi-key needle), one name
  asked for; correct when the answer contains that name's key and no other key.
- vt: variable tracking (RULER): a value bound to one variable, then passed along a chain of four
  assignments at increasing random depths, interleaved with a decoy chain (another value, four
  other names); correct when the answer names every variable of the chain and none of the decoy's.
- kl: a conversation's next `continuation` tokens teacher-forced after `context` tokens of it: the
  mean KL divergence of the policy's next-token distributions from the full cache's, and how often
  their top-1 tokens agree.
- ppl: a conversation's `context` tokens scored as chunked prefill reads them under the policy
  (jspec.score: each chunk over the cache the earlier chunks left): the perplexity, and its ratio to
  the full cache's on the same text (1 = nothing lost; the geometric mean of the samples' ratios).

"full" runs the same chunked prefill with a budget that never binds (exact attention over every
token), so every method sees the same chunking and only eviction differs (a budget below `chunk`
prefills in blocks of the budget: each record names its chunk). Each record: method,
budget, context, task, the score, peak KV-cache bytes, the run's seconds (compiles excluded) and,
for retrieval tasks, prefill seconds and decode tokens/s (`time_prefill_decode` on the first
sample).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.profiling import CompileCounter
from jspec.kv.policy import METHODS, KVPolicy
from jspec.kv.prefill import budgeted_step, chunked_prefill
from jspec.models.attention import attention_slots
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import Params
from jspec.models.numerics import engine_jit
from jspec.score import score

Array = jax.Array
TASKS = ("passkey", "multikey", "vt", "kl", "ppl")
SCORED = ("kl", "ppl")  # tasks that score a text against the full cache's, generating nothing
NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi")
ANSWER_TOKENS = {"passkey": 12, "multikey": 12, "vt": 40}  # greedy tokens generated per answer


def haystack_ids(tokenizer, texts: Iterator[str], n_tokens: int) -> list[int]:
  """Token ids of real text, conversations joined by blank lines, until n_tokens."""
  ids: list[int] = []
  for text in texts:
    ids += tokenizer.encode(text.strip() + "\n\n", add_special_tokens=False)
    if len(ids) >= n_tokens:
      return ids[:n_tokens]
  raise ValueError(f"the corpus ran out before {n_tokens} tokens of haystack")


def retrieval_prompt(tokenizer, filler: list[int], context: int, needles: Sequence[str],
                     question: str, rng: np.random.Generator) -> list[int]:
  """`context` tokens: an instruction, the filler with the needles at random depths, the question
  (a plain continuation, no chat template)."""
  head = tokenizer.encode("There is important information hidden inside a lot of irrelevant "
                          "text. Find it and memorize it.\n\n", add_special_tokens=True)
  tail = tokenizer.encode("\n\n" + question, add_special_tokens=False)
  pieces = [tokenizer.encode(" " + n.strip() + " ", add_special_tokens=False) for n in needles]
  room = context - len(head) - len(tail) - sum(len(p) for p in pieces)
  if room < 16:
    raise ValueError(f"context {context} is too short for the task's text")
  cuts = sorted(int(x) for x in rng.integers(0, room, len(pieces)))
  body, last = [], 0
  for cut, piece in zip(cuts, pieces):
    body += filler[last:cut] + piece
    last = cut
  body += filler[last:room]
  return head + body + tail


def variable_names(rng: np.random.Generator, n: int) -> list[str]:
  """n distinct variable names of five capital letters."""
  names: list[str] = []
  while len(names) < n:
    name = "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5))
    if name not in names:
      names.append(name)
  return names


def assignment_chain(names: Sequence[str], value: str) -> list[str]:
  """VAR A = value. VAR B = VAR A. ... (RULER's variable tracking, one hop per name)."""
  return [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]


def make_task(task: str, tokenizer, filler: list[int], context: int,
              rng: np.random.Generator) -> tuple[list[int], list[str], list[str]]:
  """(prompt ids, what the answer must contain, what it must not) of one retrieval sample."""
  if task == "vt":
    names = variable_names(rng, 8)
    value, decoy_value = (str(v) for v in rng.choice(np.arange(10000, 100000), 2, replace=False))
    chains = [assignment_chain(names[:4], value), assignment_chain(names[4:], decoy_value)]
    # Interleave the two chains, each in its own order (needles are placed at sorted depths).
    needles = [chains[c].pop(0) for c in rng.permutation([0] * 4 + [1] * 4)]
    prompt = retrieval_prompt(tokenizer, filler, context, needles,
                              f"Question: find all variables that are assigned the value {value}. "
                              f"Answer: the variables assigned the value {value} are", rng)
    return prompt, names[:4], names[4:]
  if task == "passkey":
    key = str(rng.integers(10000, 100000))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return (retrieval_prompt(tokenizer, filler, context, [needle],
                             "What is the pass key? The pass key is", rng), [key], [])
  names = list(rng.choice(NAMES, 4, replace=False))
  keys = [str(k) for k in rng.choice(np.arange(10000, 100000), 4, replace=False)]
  needles = [f"The pass key for {n} is {k}." for n, k in zip(names, keys)]
  ask = int(rng.integers(0, 4))
  prompt = retrieval_prompt(tokenizer, filler, context, needles,
                            f"What is the pass key for {names[ask]}? The pass key for "
                            f"{names[ask]} is", rng)
  return prompt, [keys[ask]], keys[:ask] + keys[ask + 1:]


def is_correct(answer: str, wanted: Sequence[str], others: Sequence[str]) -> bool:
  """Every wanted item (a 5-digit key or a 5-letter variable) is in the answer as a whole word,
  and none of the others (hedging between keys is wrong)."""
  found = set(re.findall(r"\b(?:\d{5}|[A-Z]{5})\b", answer))
  return all(w in found for w in wanted) and not any(o in found for o in others)


def time_prefill_decode(model, prompt: list[int], policy: KVPolicy, new_tokens: int = 129,
                        repeats: int = 3) -> tuple[float, float | None]:
  """(prefill seconds, decode tokens/s) of one prompt under `policy`, once compiled: a one-token
  run is the prefill, and decoding is (new_tokens - 1) / (a run of new_tokens - that), each the
  best of `repeats` runs taken alternately (so a slow spell of the machine hits both). A long
  prompt's prefill is seconds, so a short decode drowns in its noise: 32 tokens (before session
  39) measured +-10% on a 2-core VM."""
  def run(n):
    start = time.perf_counter()
    jax.block_until_ready(model.generate_ids([prompt], max_new_tokens=n, kv=policy,
                                             stop=False).tokens)
    return time.perf_counter() - start

  run(1), run(new_tokens)  # compile both
  one, many = zip(*[(run(1), run(new_tokens)) for _ in range(repeats)])
  prefill, total = min(one), min(many)
  if total <= prefill:  # noise larger than the decoding: no rate rather than a made-up one
    return prefill, None
  return prefill, (new_tokens - 1) / (total - prefill)


def continuation_logprobs(params: Params, cfg: Config, tokens: Array, n_prefix: int,
                          policy: KVPolicy) -> Array:
  """Log-probabilities [M, V] of the next token at each of the M = T - n_prefix positions of
  tokens [1, T] from n_prefix - 1 on, under `policy`: the prefix chunk-prefilled, the rest
  teacher-forced one token at a time with eviction as decoding does it."""
  prefix = tokens[:, :n_prefix]
  cache = KVCache.init(cfg, 1, attention_slots(cfg, policy.slots), params.embed.dtype)
  logits, cache, evicted, _ = chunked_prefill(params, cfg, prefix, jnp.asarray([n_prefix]),
                                              cache, policy)
  M = tokens.shape[1] - n_prefix

  def step(i, carry):
    cache, evicted, out = carry
    token = jax.lax.dynamic_slice(tokens, (0, n_prefix + i - 1), (1, 1))
    logits, cache, evicted = budgeted_step(params, cfg, token, cache, evicted, policy)
    return cache, evicted, out.at[i].set(jax.nn.log_softmax(logits[0, 0]))

  out = jnp.zeros((M, cfg.vocab_size), jnp.float32).at[0].set(jax.nn.log_softmax(logits[0]))
  _, _, out = jax.lax.fori_loop(1, M, step, (cache, evicted, out))
  return out


_continuation_jit = engine_jit(continuation_logprobs, static_argnums=(1, 3, 4))


def _perplexity(params: Params, cfg: Config, tokens: list[int], policy: KVPolicy) -> float:
  """The perplexity of `tokens` (their first excluded: nothing predicts it) read under `policy`."""
  return float(score(params, cfg, [tokens], chunk=policy.chunk, kv=policy).perplexity()[0])


def kl_and_agreement(full: Array, policy: Array) -> tuple[float, float]:
  """Mean KL(full || policy) in nats and top-1 agreement over the positions."""
  kl = jnp.sum(jnp.exp(full) * (full - policy), axis=-1)
  agree = jnp.argmax(full, -1) == jnp.argmax(policy, -1)
  return float(kl.mean()), float(agree.mean())


def policy_for(method: str, budget: int, context: int, max_new: int, chunk: int, sinks: int,
               window: int | None, evict_every: int = 1) -> KVPolicy:
  """The method's policy; "full" is a budget no run can fill (same chunked prefill, no eviction)."""
  if method == "full":
    return KVPolicy.never_full(context + max_new, chunk)
  return KVPolicy(method, budget=budget, sinks=sinks, window=window, chunk=min(chunk, budget),
                  evict_every=evict_every)


def cache_bytes(cfg: Config, policy: KVPolicy, itemsize: int) -> int:
  """Peak KV-cache bytes of one row: keys and values of every slot the engines allocate (the
  policy's, rounded up to the Pallas kernel's blocks: `attention_slots`), each slot's recorded
  position (int32) and, for attention-score methods, its attention mass (float32)."""
  entries = cfg.num_layers * attention_slots(cfg, policy.slots) * cfg.num_kv_heads
  per_entry = 2 * cfg.head_dim * itemsize + 4 + (4 if policy.needs_attention else 0)
  return entries * per_entry


@dataclasses.dataclass
class BenchKV:
  """What to run: methods ("full" and METHODS), budgets (slots), the context length, tasks."""

  methods: Sequence[str]
  budgets: Sequence[int]
  context: int
  tasks: Sequence[str] = ("passkey",)
  num_samples: int = 8
  chunk: int = 128
  sinks: int = 4
  window: int | None = None  # None: each method's own (KVPolicy.recent)
  evict_every: int = 1  # decoding (answers, the kl continuation): tokens between evictions
  continuation: int = 32
  seed: int = 0
  time_decode: bool = True  # prefill s and decode tok/s per record (two programs, eight runs more)
  decode_tokens: int = 129  # tokens of the run that times decoding

  def __post_init__(self):
    unknown = [m for m in self.methods if m != "full" and m not in METHODS]
    if unknown:
      raise ValueError(f"unknown KV method(s) {unknown}; known: full, {', '.join(METHODS)}")
    bad = [t for t in self.tasks if t not in TASKS]
    if bad:
      raise ValueError(f"unknown task(s) {bad}; known: {', '.join(TASKS)}")
    if self.time_decode and self.decode_tokens < 2:
      raise ValueError(f"decode_tokens {self.decode_tokens} times nothing past the prefill's "
                       f"token: give 2 or more, or turn the timing off")
    if "kl" in self.tasks and (not isinstance(self.continuation, int) or self.continuation < 1):
      raise ValueError(f"the kl task scores `continuation` tokens after the context: give a "
                       f"positive integer, got {self.continuation!r}")
    if any(b >= self.context for b in self.budgets):
      raise ValueError(f"budgets {list(self.budgets)} must be below the context {self.context} "
                       f"(a budget that holds the whole context is the full cache)")
    for method in self.methods:  # each policy's own checks (budget, sinks, window), before any run
      for budget in self.budgets if method != "full" else ():
        policy_for(method, budget, self.context, 1, self.chunk, self.sinks, self.window,
                   self.evict_every)


def run_bench_kv(model, setup: BenchKV, texts: Iterator[str], progress=print) -> list[dict]:
  """Records of every (task, method, budget) over the same samples; `progress(record)` is called
  as each one is done (the CLI saves them as it goes: a long run keeps what it measured)."""
  rng = np.random.default_rng(setup.seed)
  cfg, params = model.cfg, model.params
  itemsize = jnp.dtype(params.embed.dtype).itemsize if hasattr(params.embed, "dtype") else 4
  need = setup.context + (setup.continuation if "kl" in setup.tasks else 0)
  samples = [haystack_ids(model.tokenizer, texts, need) for _ in range(setup.num_samples)]
  # "full" runs only when listed: a later run at other budgets on the same samples (same seed,
  # context and tasks) can leave out the costliest method it already has.
  runs = [("full", setup.context)] * ("full" in setup.methods) + [
      (m, b) for m in setup.methods if m != "full" for b in setup.budgets]
  # The most tokens a run decodes past the context: "full" must never evict in any of them.
  most_new = max([*ANSWER_TOKENS.values(), setup.decode_tokens if setup.time_decode else 0])
  records = []
  for task in setup.tasks:
    if task == "kl":
      full_policy = policy_for("full", 0, need, 0, setup.chunk, 0, 0)
      tokens = [jnp.asarray([s]) for s in samples]
      reference = [_continuation_jit(params, cfg, t, setup.context, full_policy) for t in tokens]
    elif task == "ppl":
      texts_in = [s[:setup.context] for s in samples]
      full_policy = policy_for("full", 0, setup.context, 0, setup.chunk, 0, 0)
      reference = [_perplexity(params, cfg, t, full_policy) for t in texts_in]
    else:
      built = [make_task(task, model.tokenizer, s, setup.context, rng) for s in samples]
    for method, budget in runs:
      if task in SCORED and method == "full":
        continue
      policy = policy_for(method, budget, setup.context, most_new, setup.chunk, setup.sinks,
                          setup.window, setup.evict_every)
      start = time.perf_counter()
      with CompileCounter() as compiled:
        if task == "kl":
          scores = [kl_and_agreement(ref, _continuation_jit(params, cfg, t, setup.context,
                                                            policy))
                    for ref, t in zip(reference, tokens)]
          result = {"kl": float(np.mean([s[0] for s in scores])),
                    "top1_agreement": float(np.mean([s[1] for s in scores]))}
        elif task == "ppl":
          ppl = [_perplexity(params, cfg, t, policy) for t in texts_in]
          ratios = np.asarray(ppl) / np.asarray(reference)
          result = {"perplexity": float(np.exp(np.mean(np.log(ppl)))),
                    "full_perplexity": float(np.exp(np.mean(np.log(reference)))),
                    "perplexity_ratio": float(np.exp(np.mean(np.log(ratios)))),
                    "perplexity_ratios": [float(r) for r in ratios]}
        else:
          correct = []
          for prompt, wanted, others in built:
            out = model.generate_ids([prompt], max_new_tokens=ANSWER_TOKENS[task], kv=policy,
                                     stop=False)
            correct.append(is_correct(model.tokenizer.decode(out.sequences()[0]), wanted,
                                      others))
          result = {"accuracy": float(np.mean(correct)), "correct": [bool(c) for c in correct]}
      seconds = time.perf_counter() - start - compiled.seconds
      if task == "kl":
        result["continuation"] = setup.continuation
      if task not in SCORED and setup.time_decode:  # every prompt is `context` tokens: one stands
        prefill_s, decode = time_prefill_decode(model, built[0][0], policy,  # for all
                                                setup.decode_tokens)
        result.update(prefill_s=prefill_s, decode_tokens_per_s=decode)
      record = {"task": task, "method": method, "budget": policy.budget if method != "full"
                else None, "budget_fraction": budget / setup.context if method != "full" else 1.0,
                "context": setup.context, "num_samples": setup.num_samples, **result,
                "peak_kv_bytes": cache_bytes(cfg, policy, itemsize), "seconds": seconds,
                "chunk": policy.chunk, "sinks": policy.sinks, "window": policy.recent,
                "evict_every": policy.evict_every}
      records.append(record)
      progress(record)
  return records


def plot(records: list[dict], path) -> None:
  """Score vs budget fraction, one line per method, one panel per task (full as a dashed line)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = sorted({r["task"] for r in records})
  fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    key = {"kl": "kl", "ppl": "perplexity_ratio"}.get(task, "accuracy")
    rows = [r for r in records if r["task"] == task]
    for method in sorted({r["method"] for r in rows}):
      pts = sorted((r["budget_fraction"], r[key]) for r in rows if r["method"] == method)
      if method == "full":
        ax.axhline(pts[0][1], color="black", linestyle="--", label="full")
      else:
        ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xlabel("KV budget / context")
    ax.set_ylabel({"kl": "KL(full || policy), nats",
                   "perplexity_ratio": "perplexity / full cache's"}.get(key, "accuracy"))
    ax.set_title(f"{task}, context {rows[0]['context']}")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
