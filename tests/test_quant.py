"""int8 weights: the int8 x int8 matmul against a dequantize-then-matmul reference, a token's
logits bit-identical whether a forward sees it alone or inside a block and over any cache size,
int8 drafters lossless for float targets, int8 targets token-identical in chains, and in trees on
the native kernels (refused by the tree engine on XLA's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.drafting.model import ModelDrafter
from jspec.generate import generate
from jspec.models import quant
from jspec.models.attention import masked_attention
from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import forward, init_params, quantize_params
from jspec.models.numerics import engine_jit
from jspec.speculative.chain import SpecConfig, speculative_generate
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
from tiny_models import jitted_forward

TARGET = Config(arch="qwen2", vocab_size=96, hidden_size=64, intermediate_size=160, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                qkv_bias=True)
DRAFT = Config(arch="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1,
               num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
               qkv_bias=True)
# XLA's CPU reductions and attention dots change their order with the row count at real widths
# (1024+, 12 heads); narrower models are bit-identical without the care int8 needs.
WIDE = dataclasses.replace(TARGET, hidden_size=1024, intermediate_size=256, num_heads=12,
                           head_dim=128)
PROMPTS = [[5, 17, 3, 44, 2, 9, 61], [8, 1], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
# Both int8 kernels where they run: jspec's native ones are CPU kernels.
CPU_ONLY = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")
KERNELS = [pytest.param(k, marks=[CPU_ONLY] if k == "native" else []) for k in quant.KERNELS]

# (einsum, weight shape, input axes, x shape): every projection of the decoder and both heads.
PROJECTIONS = [
    ("bte,ehd->bthd", (64, 4, 16), (0,), (2, 3, 64)),
    ("btf,fe->bte", (64, 48), (0,), (2, 3, 64)),
    ("bte,ef->btf", (48, 80), (0,), (1, 1, 48)),
    ("...e,ve->...v", (96, 64), (1,), (2, 3, 64)),
    ("...e,ev->...v", (64, 96), (0,), (1, 1, 64)),
]


def reference(spec, x, w: quant.Int8Weight):
  """Dequantize both operands (activations as quantize_rows rounds them), matmul in float64."""
  xq, xs = quant.quantize_rows(x)
  xd = np.asarray(xq, np.float64) * np.asarray(xs, np.float64)
  return np.einsum(spec, xd, np.asarray(w.q, np.float64) * np.asarray(w.scale, np.float64))


@pytest.mark.parametrize("spec,shape,axes,xshape", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_int8_matmul_matches_dequantized_reference(spec, shape, axes, xshape):
  rng = np.random.default_rng(0)
  w = quant.quantize_int8(rng.standard_normal(shape).astype(np.float32), axes)
  x = jnp.asarray(rng.standard_normal(xshape).astype(np.float32))
  got = np.asarray(quant.einsum(spec, x, w))
  want = reference(spec, x, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # The tolerance has teeth: scales applied along the wrong axis (a wrong layout) fail it.
  wrong = quant.Int8Weight(w.q, jnp.flip(w.scale), w.in_axes)
  assert np.abs(np.asarray(quant.einsum(spec, x, wrong)) - want).max() > 1e-2 * np.abs(want).max()


def test_quantize_int8_is_within_half_a_step():
  w = np.random.default_rng(1).standard_normal((64, 4, 16)).astype(np.float32)
  q = quant.quantize_int8(w, (0,))
  assert q.q.dtype == jnp.int8 and q.scale.shape == (1, 4, 16) and q.out_scale().shape == (4, 16)
  assert np.all(np.abs(np.asarray(q.dense()) - w) <= np.asarray(q.scale) / 2 + 1e-7)
  assert np.abs(np.asarray(q.q)).max() == 127


def test_int8_codes_times_scales_are_exact_in_float32():
  """Every code * scale of a quantized table is exact in float32 (checked in float64), so its
  rounding cannot depend on whether a compiler fuses the product into an add (FMA)."""
  w = np.random.default_rng(3).standard_normal((257, 96)).astype(np.float32) * 0.07
  q = quant.quantize_int8(w, (1,))
  codes = np.arange(-127, 128, dtype=np.float64)
  scale = np.asarray(q.scale, np.float64)  # [257, 1]
  products32 = (codes[None].astype(np.float32) * np.asarray(q.scale)).astype(np.float64)
  np.testing.assert_array_equal(products32, codes[None] * scale)
  assert np.abs(np.asarray(q.q)).max() == 127  # rounding the scale up keeps max |w| at code 127


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="jspec's native kernels are CPU kernels")
def test_int8_block_keeps_its_bits_with_probe_masks_appended(optimised):
  """Mask-token probing runs masks after the block as appended embeddings. With int8 scales of
  24 bits, XLA:CPU fused an embedding row's q * scale into layer 0's residual add (an FMA) only
  where no masks followed, so the block's hidden states moved by ~5e-7 and the 0.5B int8 model's
  greedy probing output left autoregressive decoding on 5 of 6 MT-Bench prompts. Compiled as
  users compile (`optimised`): the suite's low optimisation level makes no FMAs."""
  from jspec.speculative.probing import causal, probe_layout
  cfg = dataclasses.replace(TARGET, head_dim=64)  # where the old scales showed it (not at 16)
  params = quantize_params(init_params(cfg, jax.random.key(2), scale=0.3), "native")
  fwd = engine_jit(forward, static_argnums=1)
  prefix = np.random.default_rng(5).integers(0, cfg.vocab_size, 40).tolist()
  P = len(prefix)
  _, _, cache = fwd(params, cfg, jnp.asarray([prefix]), jnp.arange(P)[None],
                    KVCache.init(cfg, 1, 128))
  cache = cache.commit(P)
  block, T, k = jnp.asarray([[5, 2, 8, 6]]), 4, 3
  positions = P + jnp.arange(T)[None]
  _, plain, _ = fwd(params, cfg, block, positions, cache)
  mask, probe_positions = probe_layout(causal(1, T), positions, k)
  masks = jnp.full((1, T * k, cfg.hidden_size), 0.01)
  _, probed, _ = fwd(params, cfg, block, probe_positions, cache, mask, appended=masks)
  np.testing.assert_array_equal(np.asarray(probed[:, :T]), np.asarray(plain))


def test_int8_xla_targets_refuse_probing_drafters(int8_target):
  from jspec.drafting.probe import probe_drafter
  with pytest.raises(ValueError, match="int8 target on XLA's kernel"):
    speculative_generate(int8_target, TARGET, probe_drafter(int8_target, TARGET, 2), PROMPTS,
                         spec=SpecConfig(gamma=2, max_new_tokens=4))


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


@pytest.fixture(scope="module")
def int8_target(target):
  return quantize_params(target)


def test_int8_logits_close_to_float(target, int8_target):
  tokens = jnp.asarray([PROMPTS[2]])
  positions = jnp.arange(tokens.shape[1])[None]
  ref, _, _ = jitted_forward(target, TARGET, tokens, positions, KVCache.init(TARGET, 1, 32))
  got, _, _ = jitted_forward(int8_target, TARGET, tokens, positions, KVCache.init(TARGET, 1, 32))
  # Random weights at this scale have large activations; real models land far closer
  # (benchmarks/issue17_int8_quality_cpu.json).
  scale = float(jnp.abs(ref).max())
  assert float(jnp.abs(got - ref).max()) < 0.1 * scale
  assert float(jnp.abs(got - ref).mean()) < 0.02 * scale
  assert float(jnp.abs(got - ref).max()) > 0  # it is a different model: the weights are int8


def _block_and_steps(params, cfg, T=6, mask=None, block_cache=32, step_cache=32,
                     prefix=PROMPTS[0]):
  """Hidden states of T tokens fed as one block and fed one at a time after a shared prefix,
  each way over a KV cache of its own size, in programs compiled as the engines compile theirs."""
  fwd = engine_jit(forward, static_argnums=1)
  prefix, block = jnp.asarray([prefix]), jnp.asarray([PROMPTS[2][:T]])
  P = prefix.shape[1]

  def prefilled(size):
    _, _, cache = fwd(params, cfg, prefix, jnp.arange(P)[None], KVCache.init(cfg, 1, size))
    return cache.commit(P)

  _, together, _ = fwd(params, cfg, block, P + jnp.arange(T)[None], prefilled(block_cache), mask)
  cache, alone = prefilled(step_cache), []
  for t in range(T):
    _, h, cache = fwd(params, cfg, block[:, t:t + 1], jnp.asarray([[P + t]]), cache)
    cache = cache.commit(1)
    alone.append(h)
  return together, jnp.concatenate(alone, axis=1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cfg", [TARGET, WIDE], ids=["narrow", "wide"])
def test_int8_token_bit_identical_alone_or_in_a_block(cfg, kernel):
  params = quantize_params(init_params(cfg, jax.random.key(2), scale=0.3), kernel)
  together, alone = _block_and_steps(params, cfg)
  np.testing.assert_array_equal(np.asarray(together), np.asarray(alone))
  # A tree verification passes its ancestor mask: a chain's mask is the causal one.
  causal = jnp.tril(jnp.ones((1, 6, 6), bool))
  together, alone = _block_and_steps(params, cfg, mask=causal)
  np.testing.assert_array_equal(np.asarray(together), np.asarray(alone))


# (64, 128) with each kernel, the other sizes with one kernel each (for the suite's time).
CACHE_CASES = ([pytest.param((64, 128), 50, *k.values, marks=k.marks) for k in KERNELS]
               + [pytest.param((256, 320), 170, "native", marks=CPU_ONLY),
                  ((320, 448), 170, "xla"), ((192, 1024), 170, "xla")])


@pytest.mark.parametrize("caches,prefix_len,kernel", CACHE_CASES)
def test_int8_token_bit_identical_over_any_cache_size(caches, prefix_len, kernel):
  """A speculative run reserves room for its draft block, so its cache can be bigger than the
  autoregressive run's; the extra, invisible slots must not change a bit. (64 vs 128 slots: where
  XLA:CPU's q . k dot changed its order on an AVX2 machine.)"""
  params = quantize_params(init_params(WIDE, jax.random.key(2), scale=0.3), kernel)
  # A long prefix: many visible slots, so a reordered sum shows up past int8 re-quantization.
  prefix = np.random.default_rng(5).integers(0, WIDE.vocab_size, prefix_len).tolist()
  together, alone = _block_and_steps(params, WIDE, block_cache=caches[0], step_cache=caches[1],
                                     prefix=prefix)
  np.testing.assert_array_equal(np.asarray(together), np.asarray(alone))


@pytest.mark.parametrize("B,H,D", [(1, 14, 64), (1, 12, 128), (2, 14, 64)])
@pytest.mark.parametrize("T", [1, 4])
def test_attention_bits_do_not_depend_on_the_cache_size(B, H, D, T):
  """Slots past the visible ones (NaN keys, as stale or unused slots may hold anything the mask
  hides) change nothing: the softmax's sum and the value dot see only zeros there. One row of 14
  heads is where XLA:CPU hands the softmax to YNNPACK at some cache sizes and not at others."""
  rng = np.random.default_rng(0)
  K, S_max = 2, 704
  k = rng.standard_normal((B, S_max, K, D)).astype(np.float32)
  v = rng.standard_normal((B, S_max, K, D)).astype(np.float32)
  q = jnp.asarray(rng.standard_normal((B, T, H, D)).astype(np.float32))
  attend = engine_jit(lambda q, k, v, m: masked_attention(q, k, v, m, per_token=True))
  for visible in (100, 150):
    outs = []
    for S in (256, 320, 384, 704):
      kk, vv = k[:, :S].copy(), v[:, :S].copy()
      kk[:, visible + T:] = np.nan
      vv[:, visible + T:] = 0.0
      mask = np.arange(S)[None, None] <= visible + np.arange(T)[None, :, None]  # [1, T, S]
      outs.append(np.asarray(attend(q, kk, vv, np.broadcast_to(mask, (B, T, S)))))
    assert np.isfinite(outs[0]).all()
    for out in outs[1:]:
      np.testing.assert_array_equal(out, outs[0])


@pytest.fixture(scope="module")
def int8_drafter(target):
  noise = init_params(TARGET, jax.random.key(1), scale=0.3)
  noised = jax.tree.map(lambda a, b: a + 0.5 * b if a.ndim > 1 else a, target, noise)
  return ModelDrafter(quantize_params(noised), TARGET)


def _chain_matches_generate(target, cfg, drafter, gamma, max_new_tokens):
  """Greedy chain output == greedy autoregressive output, with rejections and acceptances both
  exercised; returns the autoregressive sequences."""
  want = generate(target, cfg, PROMPTS, max_new_tokens=max_new_tokens).sequences()
  out = speculative_generate(target, cfg, drafter, PROMPTS,
                             spec=SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens))
  assert out.sequences() == want
  hist = np.asarray(out.accept_hist)
  assert hist[0] > 0 and hist[1:].sum() > 0
  return want


@pytest.mark.parametrize("gamma", [2, 4])
def test_int8_drafter_for_a_float_target_is_lossless(target, int8_drafter, gamma):
  want = _chain_matches_generate(target, TARGET, int8_drafter, gamma, 24)
  tree = tree_speculative_generate(target, TARGET, int8_drafter, PROMPTS,
                                   spec=TreeSpecConfig(tree="dynamic:8", max_new_tokens=24))
  assert tree.sequences() == want


@pytest.fixture(scope="module")
def wide_int8_pair():
  """An int8 WIDE target and an int8 drafter from its noised weights."""
  base = init_params(WIDE, jax.random.key(2), scale=0.3)
  noise = init_params(WIDE, jax.random.key(1), scale=0.3)
  noised = jax.tree.map(lambda a, b: a + 0.3 * b if a.ndim > 1 else a, base, noise)
  return quantize_params(base), ModelDrafter(quantize_params(noised), WIDE)


@pytest.mark.parametrize("gamma", [3])
def test_int8_target_chains_are_token_identical(wide_int8_pair, gamma):
  """The int8 target's own greedy output through verification blocks of gamma + 1 tokens. 47
  new tokens: the autoregressive run fits 64 cache slots, the speculative one (gamma + 1 reserved)
  gets 128, so the block also sees a different cache size. End to end on random weights this
  rarely meets a near tie, so it passes even with either cause reverted (checked); the attention
  test above is the sensitive one (so gamma 1 and 5 went for the suite's time)."""
  target, drafter = wide_int8_pair
  _chain_matches_generate(target, WIDE, drafter, gamma, 47)


def _tree_and_chain_layouts(leaf, parents, k, v, P):
  """visible [1, 1, S] for tree node `leaf` whose node j sits at slot P + j, and the cache and
  visible of the same context laid out as autoregressive decoding commits it: the node's
  ancestors (itself last) at P, P + 1, ... (NaN keys past them, as stale slots may hold)."""
  path = [leaf]
  while parents[path[-1]] >= 0:
    path.append(parents[path[-1]])
  path = path[::-1]
  S = k.shape[2]
  tree = np.zeros((1, 1, S), bool)
  tree[..., :P] = True
  tree[..., [P + j for j in path]] = True
  kc, vc = k.copy(), v.copy()
  kc[:, :, P:P + len(path)] = k[:, :, [P + j for j in path]]
  vc[:, :, P:P + len(path)] = v[:, :, [P + j for j in path]]
  kc[:, :, P + len(path):], vc[:, :, P + len(path):] = np.nan, 0.0
  chain = np.zeros((1, 1, S), bool)
  chain[..., :P + len(path)] = True
  return tree, kc, vc, chain


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="jspec's native kernels are CPU kernels")
def test_native_attention_scores_a_tree_node_as_the_chain_of_its_ancestors():
  """Why trees may verify for int8 targets on the native kernels and not on XLA's: each node of a
  12-node tree attends over the prefix and its ancestors at the tree's slots, and over the same
  keys laid out consecutively (as autoregressive decoding commits them). The native kernel's bits
  agree for every node; XLA's per-token attention (halving over all slots) differs for most, which
  also shows the comparison can fail."""
  from jspec import native
  rng = np.random.default_rng(0)
  H, K, D, S, P = 14, 2, 64, 256, 150
  parents = [-1, 0, 0, 1, 2, 3, 1, 4, 5, 6, 0, 9]
  k = rng.standard_normal((1, 1, S, K, D)).astype(np.float32) * 0.3  # spread-out softmax
  v = rng.standard_normal((1, 1, S, K, D)).astype(np.float32)
  q = rng.standard_normal((1, len(parents), H, D)).astype(np.float32) * 0.3
  nat = engine_jit(lambda q, k, v, m: native.attention(q, k, v, m, 0))
  xla = engine_jit(lambda q, k, v, m: masked_attention(q, k, v, m, per_token=True))
  xla_differs = 0
  for leaf in range(len(parents)):
    tree, kc, vc, chain = _tree_and_chain_layouts(leaf, parents, k, v, P)
    ql = q[:, leaf:leaf + 1]
    np.testing.assert_array_equal(np.asarray(nat(ql, k, v, tree)),
                                  np.asarray(nat(ql, kc, vc, chain)))
    xla_differs += not np.array_equal(np.asarray(xla(ql, k[0], v[0], tree)),
                                      np.asarray(xla(ql, kc[0], vc[0], chain)))
  assert xla_differs >= len(parents) // 2


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="jspec's native kernels are CPU kernels")
@pytest.mark.parametrize("tree", ["dynamic:8", "dynamic:16,1,1,16"])
def test_int8_native_target_trees_are_token_identical(tree):
  base = init_params(WIDE, jax.random.key(2), scale=0.3)
  noise = init_params(WIDE, jax.random.key(1), scale=0.3)
  noised = jax.tree.map(lambda a, b: a + 0.3 * b if a.ndim > 1 else a, base, noise)
  target = quantize_params(base, "native")
  drafter = ModelDrafter(quantize_params(noised, "native"), WIDE)
  want = generate(target, WIDE, PROMPTS, max_new_tokens=32).sequences()
  out = tree_speculative_generate(target, WIDE, drafter, PROMPTS,
                                  spec=TreeSpecConfig(tree=tree, max_new_tokens=32))
  assert out.sequences() == want
  assert int(out.round_tokens) > int(out.rounds)  # drafts were accepted, not only bonus tokens


def test_int8_xla_targets_are_refused_by_the_tree_engine(int8_target, int8_drafter):
  with pytest.raises(ValueError, match="tree speculative decoding with an int8 target on XLA"):
    tree_speculative_generate(int8_target, TARGET, int8_drafter, PROMPTS,
                              spec=TreeSpecConfig(tree="dynamic:8", max_new_tokens=8))


def test_int8_needs_xla_attention(int8_target):
  cfg = dataclasses.replace(TARGET, attention_impl="pallas-interpret")
  tokens = jnp.asarray([[1, 2, 3]])
  with pytest.raises(ValueError, match="int8 weights run with attention_impl='xla'"):
    forward(int8_target, cfg, tokens, jnp.arange(3)[None], KVCache.init(cfg, 1, 128))


def test_engine_options_follow_where_the_call_runs(monkeypatch):
  """The CPU options go to calls whose arrays sit on the CPU, even when the default backend is an
  accelerator (and not to calls that would run there)."""
  from jspec.models import numerics
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  on_cpu = jax.device_put(jnp.ones(3), jax.devices("cpu")[0])
  assert numerics._platform(((1, on_cpu), {})) == "cpu"
  assert numerics._platform(((jnp.ones(3),), {})) == "gpu"  # uncommitted: the default backend
  with jax.default_device(jax.devices("cpu")[0]):
    assert numerics._platform(((jnp.ones(3),), {})) == "cpu"


def test_engine_programs_run_inside_other_transformations():
  """engine_jit'd functions (forward_jit, the engines) called under a user's jit or vmap."""
  from jspec.models.numerics import engine_jit
  double = engine_jit(lambda x: 2 * x)
  np.testing.assert_array_equal(jax.jit(lambda x: double(x) + 1)(jnp.ones(2)), [3.0, 3.0])
  np.testing.assert_array_equal(jax.vmap(double)(jnp.ones((3, 2))), np.full((3, 2), 2.0))


@pytest.mark.parametrize("kernel,bits,tree", [("xla", 8, None), ("native", 4, "specinfer:3")])
def test_sampled_speculation_follows_a_quantized_targets_distribution(kernel, bits, tree):
  """T=1 with top-k under an int8 (XLA's kernel) or q4 (jspec's CPU kernel) target, a float
  drafter: the output follows the quantized target's own law, enumerated exactly (chi-square)."""
  from test_speculative import SAMPLINGS, TINY, chi_square, exact_distribution, sample_sequences
  from test_tree_engine import sample_codes
  target = quantize_params(init_params(TINY, jax.random.key(10), scale=0.8), kernel, bits)
  drafter = ModelDrafter(init_params(TINY, jax.random.key(11), scale=0.8), TINY)
  sp = SAMPLINGS["t0.7-topk"]
  codes = (sample_sequences(target, drafter, sp, gamma=2) if tree is None
           else sample_codes(target, drafter, tree, sp, 5))
  stat, dof, ok = chi_square(codes, exact_distribution(target, sp))
  assert ok, (kernel, bits, tree, stat, dof)
