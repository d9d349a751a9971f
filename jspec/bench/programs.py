"""A decoding program lowered for study: autoregressive `generate_tokens`, or speculative
decoding with a drafter (`speculative_generate_tokens`, or `tree_speculative_generate_tokens`
under a TreeSpecConfig), jitted as the engines jit them (the CPU's
COMPILER_OPTIONS where it runs on the CPU), for benchmarks that read the compiled HLO, time a
compile, or run one program many times side by side with another.
"""

from __future__ import annotations

import jax

from jspec.drafting.base import Drafter
from jspec.generate import generate_tokens
from jspec.kv.policy import KVPolicy
from jspec.models.config import Config
from jspec.models.llama import Params
from jspec.models.numerics import cpu_compiler_options
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate_tokens
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate_tokens


def lower_decode(params: Params, cfg: Config, prompt: jax.Array, lengths: jax.Array,
                 key: jax.Array, sampling: SamplingParams = GREEDY, *,
                 drafter: Drafter | None = None,
                 spec: SpecConfig | TreeSpecConfig | None = None,
                 max_new_tokens: int | None = None, cache_size: int,
                 kv: KVPolicy | None = None) -> tuple:
  """(the lowered program, the arguments its compiled form takes). Autoregressive when `drafter`
  is None (`max_new_tokens` tokens), else a speculative chain under `spec` (`max_new_tokens`,
  when given instead, makes SpecConfig(gamma=3, max_new_tokens)) or a tree under a
  TreeSpecConfig. kv: a KV budget (autoregressive only; cache_size is then ignored). Lowered now,
  so a caller that swaps a jspec function first (benchmarks comparing two versions) gets the one
  in place."""
  # Where the default backend runs it (engine_jit reads the arguments' placement instead: a
  # benchmark's arguments are uncommitted arrays on the default device).
  options = cpu_compiler_options() if jax.default_backend() == "cpu" else {}
  if drafter is None:
    if max_new_tokens is None:
      raise ValueError("an autoregressive program needs max_new_tokens")
    fn = jax.jit(generate_tokens, static_argnums=1, compiler_options=options,
                 static_argnames=("max_new_tokens", "cache_size", "kv"))
    lowered = fn.lower(params, cfg, prompt, lengths, key, sampling,
                       max_new_tokens=max_new_tokens, cache_size=cache_size, kv=kv)
    return lowered, (params, prompt, lengths, key, sampling)
  if kv is not None:
    raise ValueError("lower_decode takes a KV budget for autoregressive programs only")
  if spec is None:
    if max_new_tokens is None:
      raise ValueError("a speculative program needs spec= or max_new_tokens")
    spec = SpecConfig(gamma=3, max_new_tokens=max_new_tokens)
  engine = (tree_speculative_generate_tokens if isinstance(spec, TreeSpecConfig)
            else speculative_generate_tokens)
  fn = jax.jit(engine, static_argnums=1, compiler_options=options,
               static_argnames=("spec", "cache_size"))
  lowered = fn.lower(params, cfg, drafter, prompt, lengths, key, sampling, spec=spec,
                     cache_size=cache_size)
  return lowered, (params, drafter, prompt, lengths, key, sampling)
