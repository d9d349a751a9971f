"""A loaded model: config, params and tokenizer together, with text in and text out.

Drafters by name for it: jspec.drafting.registry.load_drafter(name, model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax

from jspec.drafting.base import Drafter
from jspec.generate import GenerateOutput, generate
from jspec.io.load import DEFAULT, QUANTIZED, load_checkpoint, on_xla
from jspec.io.tokenizer import Tokenizer
from jspec.kv.policy import KVPolicy
from jspec.models.config import Config
from jspec.models.llama import Params, place_params, repeat_kv_heads, stack_layers
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.score import ScoreOutput, score
from jspec.sharding import Mesh, kv_repeats, mesh_from, model_placement
from jspec.speculative.chain import SpecConfig, SpecOutput, speculative_generate
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from jspec.streaming import TextStream, TokenStream, check_stop
from jspec.tree.shapes import TreeShape


# Loop iterations (tokens, or speculative rounds) between the checks for stop strings of
# `generate_text`: a stopped row may generate up to twice this many more tokens (or rounds) before
# it halts; each check costs a dispatch and a read of the token buffer.
STOP_EVERY = 4


@dataclasses.dataclass
class Model:
  cfg: Config
  params: Params
  tokenizer: Tokenizer
  source: str
  mesh: Mesh | None = None  # where params live and every generate runs (jspec.sharding)

  def encode(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
    """Token ids for a prompt, wrapped in the chat template when `chat`."""
    if not isinstance(text, str):
      raise TypeError(f"encode takes one text (a str), got {type(text).__name__}"
                      + (": encode each prompt of a list" if isinstance(text, (list, tuple))
                         else ""))
    if chat:
      messages = ([{"role": "system", "content": system}] if system else [])
      messages.append({"role": "user", "content": text})
      text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
      return self.tokenizer.encode(text, add_special_tokens=False)
    return self.tokenizer.encode(text, add_special_tokens=True)

  def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                   sampling: SamplingParams = GREEDY, key: jax.Array | int = 0,
                   stop: bool = True, drafter: Drafter | None = None, gamma: int | None = None,
                   tree: TreeShape | str | None = None,
                   precision: str = "fast", kv: KVPolicy | None = None,
                   draft_kv: KVPolicy | None = None, logprobs: str | None = None,
                   _stream: bool = False) -> GenerateOutput | SpecOutput:
    """Autoregressive generation, or speculative when a drafter is given (same output law):
    chains of `gamma` drafts (default 4; a probing drafter's mask count), or token trees of shape
    `tree` (e.g. "dynamic:32"; gamma beside it is refused; a drafter with a tree of its own,
    lookahead's n-gram pool, grows that one). gamma applies to chains only: without a drafter,
    or with a drafter that grows its own tree, it is not used. precision:
    "fast" or "exact" (full float32 matmuls: greedy speculative output token-identical to
    greedy autoregressive output on GPUs/TPUs too; jspec.models.numerics). kv: a KV budget
    (`jspec.kv.policy.KVPolicy`): any prompt length in a fixed target memory; draft_kv: a
    key-scored budget for a model drafter's own cache (None: full). logprobs: "model" or
    "sampled": out.logprobs [B, N], each generated token's log-probability (the model's own, or
    under the sampling settings; jspec.sampling.logprobs)."""
    stop_ids = tuple(self.tokenizer.stop_token_ids) if stop else ()
    if isinstance(drafter, str):
      raise TypeError(f"drafter= takes a drafter, got the name {drafter!r}. Fix: "
                      f"drafter=jspec.drafting.registry.load_drafter({drafter!r}, model)")
    if tree is not None and gamma is not None:
      raise ValueError(f"gamma={gamma} sets a chain's length, but tree={tree!r} drafts a tree: "
                       f"drop gamma")
    if drafter is None:
      if tree is not None:
        raise ValueError(f"tree {tree} needs a drafter to draft it: pass drafter=")
      if draft_kv is not None:
        raise ValueError("draft_kv budgets a drafter's cache; pass a drafter= too, or drop it")
      return generate(self.params, self.cfg, prompts, max_new_tokens=max_new_tokens,
                      sampling=sampling, key=key, stop_ids=stop_ids, precision=precision, kv=kv,
                      logprobs=logprobs, mesh=self.mesh, _stream=_stream)
    tree = drafter.own_tree if tree is None else tree  # a lookahead pool's n-gram tree
    if tree is not None:
      return tree_speculative_generate(
          self.params, self.cfg, drafter, prompts, sampling=sampling, key=key,
          spec=TreeSpecConfig(tree, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                              logprobs=logprobs),
          precision=precision, kv=kv, draft_kv=draft_kv, mesh=self.mesh, _stream=_stream)
    gamma = (drafter.probe_masks or 4) if gamma is None else gamma
    spec = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                      logprobs=logprobs)
    return speculative_generate(self.params, self.cfg, drafter, prompts, spec=spec,
                                sampling=sampling, key=key, precision=precision, kv=kv,
                                draft_kv=draft_kv, mesh=self.mesh, _stream=_stream)

  def stream_ids(self, prompts: Sequence[Sequence[int]], *, every: int = 1,
                 **kwargs) -> TokenStream:
    """`generate_ids`, streamed: iterate for each row's new ids (a list per row) every `every`
    loop iterations (tokens, or speculative rounds); then `.output` is what `generate_ids`
    returns, the same tokens. Takes `generate_ids`'s arguments, checked here."""
    run, owners = self.generate_ids(prompts, _stream=True, **kwargs)
    return TokenStream(run, every, owners=owners)

  def check_stop_strings(self, stop_strings: Sequence[str] | str | None) -> tuple[str, ...]:
    """Stop strings as a tuple, refused where one could never match (it holds a special token's
    text, which decoded text never shows: `Tokenizer.check_stop_strings`)."""
    stop_strings = check_stop(stop_strings)
    if hasattr(self.tokenizer, "check_stop_strings"):  # jspec's Tokenizer (tests pass byte ones)
      self.tokenizer.check_stop_strings(stop_strings)
    return stop_strings

  def stream_text(self, prompts: Sequence[str] | str, *, chat: bool = True, every: int = 1,
                  stop_strings: Sequence[str] | str | None = None, **kwargs) -> TextStream:
    """`generate_text`, streamed: iterate for the new text (one prompt given as a str: a str;
    else a list, one per prompt); the pieces join to `generate_text`'s text. stop_strings: text
    that ends an answer (cut before it; the row stops generating), as for `generate_text`."""
    stop_strings = self.check_stop_strings(stop_strings)
    single = isinstance(prompts, str)
    ids = [self.encode(p, chat) for p in text_prompts(prompts)]
    return TextStream(self.stream_ids(ids, every=every, **kwargs), self.tokenizer.decode, single,
                      stop_strings)

  def score_ids(self, sequences: Sequence[Sequence[int]], *, chunk: int = 128,
                kv: KVPolicy | None = None, precision: str = "fast") -> ScoreOutput:
    """The model's log-probability of every token of each row given those before it
    (jspec.score): `.sums(starts)` a continuation's log-likelihood, `.perplexity()`; under a KV
    budget `kv`, as read under that policy."""
    return score(self.params, self.cfg, sequences, chunk=chunk, kv=kv, precision=precision,
                 mesh=self.mesh)

  def score_text(self, texts: Sequence[str] | str, **kwargs) -> ScoreOutput:
    """`score_ids` of texts (one str is one text), tokenized as they are (no chat template; the
    tokenizer's BOS if it adds one)."""
    texts = [texts] if isinstance(texts, str) else texts
    return self.score_ids([self.encode(t, chat=False) for t in texts], **kwargs)

  def off_mesh_for(self, batch: int) -> "Model":
    """This model, or (when `batch` rows cannot split over its mesh's dp) the same weights run
    without pinning a placement: internal one-prompt calls (calibrations) on a dp mesh."""
    if self.mesh is None or batch % self.mesh.shape["dp"] == 0:
      return self
    return dataclasses.replace(self, mesh=None)

  def generate_text(self, prompts: Sequence[str] | str, *, chat: bool = True,
                    stop_strings: Sequence[str] | str | None = None, **kwargs) -> list[str]:
    """Generate continuations of text prompts; returns the decoded new text per prompt (one
    str given is one prompt: a list of one text back). stop_strings: a string or strings that
    end an answer: its text is cut before the first one, and a row that reaches one stops
    generating (the run is streamed and checks the text every `every` = STOP_EVERY loop
    iterations; it ends when every row has stopped). Token ids that end an answer are the
    tokenizer's stop ids, on unless `stop=False` (as for `generate_ids`)."""
    prompts = text_prompts(prompts)
    if check_stop(stop_strings):
      every = kwargs.pop("every", STOP_EVERY)
      stream = self.stream_text(prompts, chat=chat, every=every,
                                stop_strings=stop_strings, **kwargs)
      texts = [""] * len(prompts)
      for pieces in stream:
        texts = [text + piece for text, piece in zip(texts, pieces)]
      return texts
    if "every" in kwargs:
      raise ValueError(f"every={kwargs['every']} sets how often stop strings are checked, but no "
                       f"stop_strings are given. Fix: drop every (or pass stop_strings=)")
    out = self.generate_ids([self.encode(p, chat) for p in prompts], **kwargs)
    return [self.tokenizer.decode(seq) for seq in out.sequences()]


def text_prompts(prompts: Sequence[str] | str) -> list[str]:
  """The text API's prompts as a list of texts (one str: one prompt); token ids or an empty list
  are refused with the call they need."""
  if isinstance(prompts, str):
    return [prompts]
  prompts = list(prompts)
  if not prompts:
    raise ValueError("no prompts: generate_text / stream_text take a text or a list of texts")
  if not all(isinstance(p, str) for p in prompts):
    kind = type(next(p for p in prompts if not isinstance(p, str))).__name__
    raise TypeError(f"generate_text / stream_text take texts, got a {kind} among the prompts. "
                    f"Fix: Model.generate_ids / stream_ids for token ids")
  return prompts


# Weight formats whose every matmul and attention run jspec's CPU kernels on CPU: stacked, they
# compile 3-7x faster than unrolled and decode as fast (benchmarks/README.md, "jspec's CPU kernels
# over stacked layers"), so `load` stacks them unless told otherwise.
CPU_KERNEL_FORMATS = ("float32", "int8", "q4")


def stacks_by_default(dtype: str, mesh: Mesh | None) -> bool:
  """Whether `load(..., scan_layers=None)` stacks the layers: weights on jspec's CPU kernels (on
  CPU, no mesh), where stacked programs compile several times faster at the same decode speed.
  XLA's formats stacked slice every layer's weights out each step (on CPU 0.82-1.05x the decode
  speed of the same format unrolled) and GPUs' decode speed stacked is measured only for one
  step, so there it stays a choice (`scan_layers=True`)."""
  return mesh is None and dtype in CPU_KERNEL_FORMATS and jax.default_backend() == "cpu"


def load(name_or_path: str | Path = DEFAULT, dtype: str = "float32",
         mesh: Mesh | str | None = None, scan_layers: bool | None = None) -> Model:
  """Load weights and tokenizer from "default", a .gguf file or an HF directory.

  mesh: a ("dp", "tp") `jax.sharding.Mesh` or its text ("dp=2,tp=4", jspec.sharding.make_mesh):
  params are placed on it by their logical axes (heads, MLP, vocabulary over tp) and every
  generate of the model runs there; where tp is a multiple of the KV heads, each is repeated so
  the KV cache splits tp ways (`cfg.num_kv_heads` then counts the copies). jspec's CPU kernels
  take whole weights, so on a mesh "float32" means XLA's float32 dot ("float32-xla"); int8 and q4
  are refused.

  scan_layers: every layer's arrays stacked on a leading axis, so the decoder is one `lax.scan`
  (`jspec.models.llama.stack_layers`): programs compile several times faster, which accelerators
  and deep targets want; every weight format scans (jspec's CPU kernels read the layer in place
  from the stacked weights). None (the default): stacked for weights on jspec's CPU kernels
  (float32, int8, q4 on CPU without a mesh; `stacks_by_default`), unrolled otherwise. Model
  drafters loaded for a stacked target are stacked too. On XLA's CPU dot (float32-xla, bfloat16,
  a mesh of CPU devices) a stacked decoder runs 2-3x slower a token than an unrolled one (the
  default model, 4 prompts x 24 greedy tokens, one device: 9.0 s vs 3.4 s once compiled): XLA:CPU
  copies each layer's weight slice out before its dot reads it (benchmarks/scan_slice_copy.py)."""
  mesh = mesh_from(mesh)
  if scan_layers is None:
    scan_layers = stacks_by_default(dtype, mesh)
  if mesh is not None:
    if dtype in QUANTIZED:
      raise ValueError(f"--weights {dtype}: quantized weights keep jspec's own storage layout, "
                       f"which is not placed on a mesh. Fix: weights float32 or bfloat16 "
                       f"(--weights, load(..., dtype=)) with the mesh, or drop --mesh / mesh=.")
    dtype = on_xla(dtype)
  cfg, params, tokenizer, path = load_checkpoint(name_or_path, dtype)
  if mesh is not None:
    # tp over more devices than KV heads: one KV head a device rather than all on every device.
    params, cfg = repeat_kv_heads(params, cfg, kv_repeats(cfg, mesh))
  if scan_layers:  # after the KV heads repeat, before placing (the stacked layout has an L axis)
    params = stack_layers(params)
  if mesh is not None:
    params = place_params(params, cfg, model_placement(cfg, mesh))
  return Model(cfg=cfg, params=params, tokenizer=tokenizer, source=str(path), mesh=mesh)
