"""The precision contract (jspec.models.numerics): "exact" traces every matmul at full float32
precision (model, attention, the Pallas kernel), "fast" leaves the backend's default, and every
engine traces at the precision its caller asks for. On CPU both compute alike, so the program's
marks are what can be checked here; on an accelerator they decide greedy identity."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec.generate
import jspec.speculative.chain
import jspec.speculative.tree
from jspec.drafting.model import self_drafter
from jspec.model import Model
from jspec.models import numerics
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import forward, init_params
from jspec.models.numerics import matmul_precision
from jspec.pallas.tree_attention import tree_attention

CFG = Config(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def dot_precisions(jaxpr) -> list:
  """The precision of every dot_general in a jaxpr, nested ones (loops, kernels) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += dot_precisions(inner)
  return found


def _forward_jaxpr(cfg: Config):
  params = init_params(cfg, jax.random.key(0))
  cache = KVCache.init(cfg, 1, 32, jnp.float32)
  tokens = jnp.zeros((1, 4), jnp.int32)
  positions = jnp.arange(4, dtype=jnp.int32)[None]
  return jax.make_jaxpr(lambda p, c: forward(p, cfg, tokens, positions, c))(params, cache).jaxpr


@pytest.mark.parametrize("impl", ["xla", "pallas-interpret"])
def test_exact_marks_every_matmul_of_the_forward(impl):
  cfg = dataclasses.replace(CFG, attention_impl=impl)
  with matmul_precision("exact"):
    exact = dot_precisions(_forward_jaxpr(cfg))
  with jax.default_matmul_precision(None), matmul_precision("fast"):  # (conftest: accelerators)
    fast = dot_precisions(_forward_jaxpr(cfg))
  # 7 projections a layer, 2 attention dots (XLA) or the kernel's 2, and the LM head.
  assert len(exact) == len(fast) >= 2 * 9 + 1
  assert all(p == HIGHEST for p in exact)
  assert all(p is None for p in fast)


def test_exact_marks_the_tree_attention_kernel():
  q = jnp.zeros((1, 4, 4, 16))
  kv = jnp.zeros((1, 1, 128, 2, 16))
  lengths = jnp.asarray([8], jnp.int32)
  run = lambda q, k, v: tree_attention(q, k, v, lengths, None, layer=0, interpret=True)
  with matmul_precision("exact"):
    exact = dot_precisions(jax.make_jaxpr(run)(q, kv, kv).jaxpr)
  with jax.default_matmul_precision(None), matmul_precision("fast"):
    fast = dot_precisions(jax.make_jaxpr(run)(q, kv, kv).jaxpr)
  assert len(exact) == len(fast) >= 2
  assert all(p == HIGHEST for p in exact) and all(p is None for p in fast)


@pytest.fixture
def tiny():
  return Model(CFG, init_params(CFG, jax.random.key(1), scale=0.3), tokenizer=None, source="tiny")


@pytest.mark.parametrize("engine", ["generate", "chain", "tree"])
def test_every_engine_traces_at_the_precision_asked(tiny, engine, monkeypatch):
  module = {"generate": jspec.generate, "chain": jspec.speculative.chain,
            "tree": jspec.speculative.tree}[engine]
  seen = []
  real = module.forward

  def spy(*args, **kwargs):
    seen.append(jax.config.jax_default_matmul_precision)
    return real(*args, **kwargs)

  monkeypatch.setattr(module, "forward", spy)
  kwargs = {} if engine == "generate" else {"drafter": self_drafter(tiny.params, CFG)}
  kwargs.update({"chain": {"gamma": 2}, "tree": {"tree": "fixed:2-1"}}.get(engine, {}))
  outputs = {}
  for precision in ("exact", "fast"):
    jax.clear_caches()  # trace again: the spy sees what the program is traced under
    seen.clear()
    with jax.default_matmul_precision(None):  # no global setting (conftest: accelerators)
      out = tiny.generate_ids([[3, 1, 4, 1, 5]], max_new_tokens=6, stop=False,
                              precision=precision, **kwargs)
    outputs[precision] = out.sequences()
    assert seen, "the engine was not traced"
    assert set(seen) == ({"highest"} if precision == "exact" else {None}), seen
  if jax.default_backend() == "cpu":  # full float32 in both
    np.testing.assert_array_equal(outputs["exact"], outputs["fast"])


def test_precision_names_are_checked(tiny):
  with pytest.raises(ValueError, match="precision must be 'fast'.*or 'exact'"):
    tiny.generate_ids([[1, 2]], max_new_tokens=2, stop=False, precision="highest")
  with pytest.raises(ValueError, match="precision must be"):
    tiny.generate_ids([[1, 2]], max_new_tokens=2, stop=False,
                      drafter=self_drafter(tiny.params, CFG), precision="tf32")
  with pytest.raises(ValueError, match="precision must be"):
    with matmul_precision("bf16"):
      pass


def test_benchmark_programs_compile_with_the_engines_cpu_options(tiny, monkeypatch):
  """jspec.bench.programs.lower_decode jits as engine_jit does: the CPU's compiler options reach
  the compile (a bogus one makes it fail), and its AR and chain programs decode alike."""
  import jspec.bench.programs as programs
  from jspec.sampling.processing import SamplingParams

  prompt = jnp.asarray([[3, 1, 4, 1, 5, 0, 0, 0]], jnp.int32)
  lengths, key = jnp.asarray([5], jnp.int32), jax.random.key(0)
  sampling = jax.tree.map(jnp.asarray, SamplingParams())
  lowered, call = programs.lower_decode(tiny.params, CFG, prompt, lengths, key, sampling,
                                        max_new_tokens=6, cache_size=32)
  ar = lowered.compile()(*call)
  lowered, call = programs.lower_decode(tiny.params, CFG, prompt, lengths, key, sampling,
                                        drafter=self_drafter(tiny.params, CFG),
                                        max_new_tokens=6, cache_size=32)
  chain = lowered.compile()(*call)
  np.testing.assert_array_equal(np.asarray(chain.tokens)[:, :6], np.asarray(ar.tokens)[:, :6])
  if jax.default_backend() != "cpu":
    return
  monkeypatch.setattr(programs, "cpu_compiler_options", lambda: {"xla_no_such_option": "1"})
  lowered, _ = programs.lower_decode(tiny.params, CFG, prompt, lengths, key, sampling,
                                     max_new_tokens=6, cache_size=32)
  with pytest.raises(Exception, match="xla_no_such_option"):
    lowered.compile()


def _field_twins(n: int) -> list[type]:
  """n registered dataclasses alike in every field, each with its own class constant."""
  twins = []
  for i in range(n):
    cls = dataclasses.make_dataclass(f"Twin{i}", [("x", jax.Array)])
    cls.constant = float(i)
    twins.append(jax.tree_util.register_dataclass(cls, data_fields=["x"], meta_fields=[]))
  return twins


def test_engine_programs_are_keyed_by_the_drafters_classes():
  """jaxlib 0.10.2 compares register_dataclass treedefs without their classes, so plain jit may
  run one class's program for a field-identical other (a drafter subclass that only overrides
  methods). engine_jit's keyed_by_class puts the classes into the program's key: each of 200
  twins gets its own program. (Without the key ~1 in 6 got another's, checked.) The chain and
  tree engines key by their drafter argument."""
  run = numerics.engine_jit(lambda twin, scale: twin.x * type(twin).constant * scale,
                            keyed_by_class=(0,), static_argnums=(1,))
  twins = _field_twins(200)
  got = [float(run(twin(jnp.float32(1.0)), 2)) for twin in twins]
  assert got == [2.0 * i for i in range(len(twins))]
  assert jspec.speculative.chain._spec_jit.keyed_by_class == (2,)
  assert jspec.speculative.tree._tree_jit.keyed_by_class == (2,)
