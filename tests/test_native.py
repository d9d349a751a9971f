"""jspec's native CPU int8 kernel (`jspec.native`): exact against an int64 matmul at every row count
and tail, bit-identical to XLA's int8 dot inside `quant.einsum` and a whole forward, greedy chains
token-identical through it, the custom call really in the program, and clear errors."""

import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import native
from jspec.drafting.model import ModelDrafter
from jspec.io.load import QUANTIZED, int8_kernel
from jspec.models import quant
from jspec.models.attention import attention_mass, masked_attention
from jspec.models.cache import KVCache
from jspec.models.llama import forward, init_params, native_float_params, quantize_params
from tests.test_quant import PROJECTIONS, PROMPTS, WIDE, _chain_matches_generate
from tiny_models import jitted_forward

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


def _int8(rng, shape):
  return rng.integers(-128, 128, shape).astype(np.int8)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 9])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 33), (37, 200), (130, 1536), (5, 65), (64, 4864)])
def test_int8_matmul_is_exact(M, N, K):
  """Every activation-row pass (1-5 rows at once, then 4 at a time), row blocks of 4 and their
  remainder, K tails under 64 bytes, the full int8 range and thread chunks of 32 rows."""
  rng = np.random.default_rng(M * 1000 + N + K)
  x, w = _int8(rng, (M, K)), _int8(rng, (N, K))
  got = np.asarray(jax.jit(native.int8_matmul)(jnp.asarray(x), jnp.asarray(w)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, x.astype(np.int64) @ w.astype(np.int64).T)


def test_int8_matmul_extremes_do_not_overflow():
  K = 8960  # the widest input of the 1.5B model's matmuls
  x = np.full((5, K), -128, np.int8)
  w = np.stack([np.full(K, -128, np.int8), np.full(K, 127, np.int8)])
  got = np.asarray(native.int8_matmul(jnp.asarray(x), jnp.asarray(w)))
  np.testing.assert_array_equal(got, x.astype(np.int64) @ w.astype(np.int64).T)


def test_int8_matmul_refuses_bad_operands():
  x, w = jnp.zeros((2, 8), jnp.int8), jnp.zeros((3, 8), jnp.int8)
  with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
    native.int8_matmul(x, w.T)
  with pytest.raises(ValueError, match="int8 operands"):
    native.int8_matmul(x.astype(jnp.float32), w)


@pytest.mark.parametrize("M", [1, 5, 9])
@pytest.mark.parametrize("K", [16, 37, 200])
def test_int8_linear_quantizes_like_xla(M, K):
  """The fused call (rows quantized inside, sums scaled) gives the bits of quantize_rows, XLA's
  int8 dot and the float scaling: vector body and scalar tail of the quantizer, an all-zero row
  (scale 1), and halves that round to even (2.5 -> 2, -3.5 -> -4; away from zero would differ).
  True divisions instead of quantize_rows' reciprocals fail it (scales a bit off, -3.5 -> -3)."""
  rng = np.random.default_rng(M * 100 + K)
  x = rng.standard_normal((M, K)).astype(np.float32)
  s = np.float32(101) * (np.float32(1) / np.float32(127))  # row 0's scale
  step = np.float32(1) / (np.float32(1) / s)  # x = t * step gives x * (1 / s) == t exactly here
  x[0, :4] = [101.0, *(np.float32([2.5, -3.5, 0.5]) * step)]
  x[0, 4:] = np.clip(x[0, 4:], -0.4 * s, 0.4 * s)
  if M > 1:
    x[1] = 0.0
  w = _int8(rng, (7, K))
  w_scale = rng.random(7).astype(np.float32)
  got = np.asarray(native.int8_linear(jnp.asarray(x), jnp.asarray(w), jnp.asarray(w_scale)))
  xq, xs = quant.quantize_rows(jnp.asarray(x))
  assert list(np.asarray(xq)[0, :4]) == [127, 2, -4, 0] and float(xs[0, 0]) == s
  dot = jnp.einsum("mk,nk->mn", xq, jnp.asarray(w), preferred_element_type=jnp.int32)
  want = np.asarray(dot.astype(jnp.float32) * xs * jnp.asarray(w_scale)[None])
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=r"w_scale \[N\]"):
    native.int8_linear(jnp.asarray(x), jnp.asarray(w), jnp.ones(3, jnp.float32))
  with pytest.raises(ValueError, match="float32 x"):
    native.int8_linear(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), jnp.asarray(w_scale))


@pytest.mark.parametrize("spec,shape,axes,xshape", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_native_weight_is_the_same_weight(spec, shape, axes, xshape):
  """Stored output-major, a native Int8Weight reads as the same weight (shape, dense, scales) and
  its matmul gives XLA's int8 dot's bits exactly (integer sums, the same float scaling)."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal(shape).astype(np.float32)
  xla, nat = quant.quantize_int8(w, axes), quant.quantize_int8(w, axes, "native")
  assert nat.shape == xla.shape == shape and nat.q.shape[-1] == shape[axes[0]]
  np.testing.assert_array_equal(np.asarray(nat.dense()), np.asarray(xla.dense()))
  np.testing.assert_array_equal(np.asarray(nat.out_scale()), np.asarray(xla.out_scale()))
  for rows in (xshape, (1, 5, xshape[-1])):
    x = jnp.asarray(rng.standard_normal(rows).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(quant.einsum(spec, x, nat)),
                                  np.asarray(quant.einsum(spec, x, xla)))


def test_native_reshape_merges_input_axes():
  """wo [H, D, E] is read as [H * D, E]: the native copy stores [E, H, D] -> [E, H * D]."""
  rng = np.random.default_rng(1)
  w = rng.standard_normal((4, 16, 64)).astype(np.float32)
  xla = quant.quantize_int8(w, (0, 1)).reshape(64, 64)
  nat = quant.quantize_int8(w, (0, 1), "native").reshape(64, 64)
  assert nat.q.shape == (64, 64) and nat.in_axes == (0,)
  np.testing.assert_array_equal(np.asarray(nat.dense()), np.asarray(xla.dense()))
  x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(quant.einsum("btf,fe->bte", x, nat)),
                                np.asarray(quant.einsum("btf,fe->bte", x, xla)))


# D = 160: two register tiles of outputs (8 + 2 chunks); D = 24: a masked chunk; S = 70: slot
# blocks of 32 and groups of 4 with tails.
@pytest.mark.parametrize("B,T,H,K,D,S", [(1, 1, 12, 2, 128, 512), (2, 5, 6, 2, 32, 40),
                                          (1, 4, 4, 4, 24, 17), (1, 3, 8, 1, 160, 70)])
def test_native_attention_matches_the_reference(B, T, H, K, D, S):
  """Against XLA's masked attention, layer by layer of a stacked cache whose invisible slots hold
  NaN (a kernel that reads one fails)."""
  rng = np.random.default_rng(B * T + D)
  L = 3
  k = rng.standard_normal((L, B, S, K, D)).astype(np.float32)
  v = rng.standard_normal((L, B, S, K, D)).astype(np.float32)
  q = jnp.asarray(rng.standard_normal((B, T, H, D)).astype(np.float32))
  visible = rng.random((B, T, S)) < 0.6
  visible[..., 0] = True
  hidden = ~visible.any(axis=1)  # [B, S]: slots no token of the row sees
  k[:, hidden], v[:, hidden] = np.nan, np.nan
  k, v, visible = jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible)
  for layer in range(L):
    got = np.asarray(native.attention(q, k, v, visible, layer))
    clean = lambda a: jnp.nan_to_num(a[layer], nan=0.0)
    want = np.asarray(masked_attention(q, clean(k), clean(v), visible))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # with_mass: the same outputs, bit for bit, and each token's probabilities averaged over
    # the query heads of each KV head (0 where the token does not see the slot).
    out, mass = (np.asarray(a) for a in native.attention(q, k, v, visible, layer,
                                                          with_mass=True))
    np.testing.assert_array_equal(out, got)
    per_head = np.zeros((B, T, S, K))
    for t in range(T):
      w = np.zeros((B, T), np.float32)
      w[:, t] = 1
      per_head[:, t] = np.asarray(attention_mass(q, clean(k), visible, jnp.asarray(w)))
    np.testing.assert_allclose(mass, per_head, rtol=2e-5, atol=2e-7)
    assert np.all(mass[~np.asarray(visible)] == 0)


def test_native_attention_refuses_bad_operands():
  q, kv = jnp.zeros((1, 2, 4, 8)), jnp.zeros((2, 1, 16, 2, 8))
  with pytest.raises(ValueError, match=r"layer 2 is out of \[0, 2\)"):
    native.attention(q, kv, kv, jnp.ones((1, 2, 16), bool), 2)
  with pytest.raises(ValueError, match="float32 cache"):
    native.attention(q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16),
                     jnp.ones((1, 2, 16), bool), 0)
  with pytest.raises(ValueError, match="at most 64 query heads per KV head"):
    native.attention(jnp.zeros((1, 2, 130, 8)), kv, kv, jnp.ones((1, 2, 16), bool), 0)


def test_native_forward_matches_xla_int8():
  """The same int8 model through both kernels: the projections give the same bits; attention sums
  in another (fixed) order, so logits agree to float32 rounding."""
  params = init_params(WIDE, jax.random.key(2), scale=0.3)
  tokens = jnp.asarray([PROMPTS[2][:6]])
  positions = jnp.arange(6)[None]
  logits = {}
  for kernel in quant.KERNELS:
    cache = KVCache.init(WIDE, 1, 32)
    logits[kernel], _, _ = jitted_forward(
        quantize_params(params, kernel), WIDE, tokens, positions, cache)
  np.testing.assert_allclose(np.asarray(logits["native"]), np.asarray(logits["xla"]),
                             rtol=1e-3, atol=1e-3 * float(jnp.abs(logits["xla"]).max()))


def test_the_program_calls_the_kernel():
  """No silent fallback: every quantized projection of a native model is the custom call, and
  no int8 dot is left to XLA."""
  params = quantize_params(init_params(WIDE, jax.random.key(2), scale=0.3), "native")
  hlo = jitted_forward.lower(
      params, WIDE, jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None],
      KVCache.init(WIDE, 1, 16)).as_text()
  calls = hlo.count(f"@{native.INT8_LINEAR}")  # StableHLO
  assert calls >= 7 * WIDE.num_layers + 1, calls  # 7 projections a layer + the head
  assert hlo.count(f"@{native.ATTENTION}") == WIDE.num_layers
  int8_dots = [line for line in hlo.splitlines() if "dot_general" in line and "xi8>" in line]
  assert not int8_dots, f"an int8 dot left to XLA: {int8_dots[0]}"
  xla = quantize_params(init_params(WIDE, jax.random.key(2), scale=0.3))
  hlo = jitted_forward.lower(
      xla, WIDE, jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None],
      KVCache.init(WIDE, 1, 16)).as_text()
  assert native.INT8_LINEAR not in hlo and "xi8>" in hlo  # the check above can see an int8 dot


def test_native_int8_chains_are_token_identical():
  base = init_params(WIDE, jax.random.key(2), scale=0.3)
  noise = init_params(WIDE, jax.random.key(1), scale=0.3)
  noised = jax.tree.map(lambda a, b: a + 0.3 * b if a.ndim > 1 else a, base, noise)
  target = quantize_params(base, "native")
  drafter = ModelDrafter(quantize_params(noised, "native"), WIDE)
  _chain_matches_generate(target, WIDE, drafter, 3, 47)


def test_weight_formats_choose_their_kernel():
  assert QUANTIZED == ("int8", "int8-xla", "q4")
  assert int8_kernel("int8") == "native" and int8_kernel("int8-xla") == "xla"
  with pytest.raises(ValueError, match="int8 kernel must be one of"):
    quant.quantize_int8(np.ones((4, 4), np.float32), (0,), "pallas")


def test_a_missing_compiler_fails_loudly(monkeypatch):
  monkeypatch.setenv("CXX", "no-such-compiler")
  monkeypatch.setattr(native.shutil, "which", lambda name: None)
  with pytest.raises(native.NativeKernelError, match="int8-xla"):
    native.build()


def test_a_failing_compile_fails_loudly(monkeypatch, tmp_path):
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DJSPEC_BROKEN", "-include", "no_such.h"))
  with pytest.raises(native.NativeKernelError, match="compiling jspec's native CPU kernels failed"):
    native.build()
  assert not list((tmp_path / "native").glob("*.so"))


def _unpack(codes):
  """Codes [N, K] from bytes [N, K / 2] as the kernel documents them, input by input: superblocks
  of 16 groups of 32 (the last holds the rest), each 4 chunks of 4 g bytes, byte 4 l + i of chunk
  c holding input 32 l + 4 c + i of the superblock (low nibble) and input 32 l + 16 + 4 c + i."""
  N, half = codes.shape
  K = 2 * half
  out = np.zeros((N, K), np.int64)
  for i in range(K):
    s, within = divmod(i, 512)
    g = min(16, K // 32 - 16 * s)
    l, j = divmod(within, 32)
    c, b = divmod(j % 16, 4)
    byte = codes[:, 256 * s + 4 * g * c + 4 * l + b]
    out[:, i] = byte & 15 if j < 16 else byte >> 4
  return out


def _q4_reference(x, codes, scale, offset=None):
  """float64 sum over groups of scale * (x . (code - 8)), or with offsets of
  scale * (x . code) + offset * sum(x)."""
  N = codes.shape[0]
  q = _unpack(codes).reshape(N, -1, 32) - (8 if offset is None else 0)  # [N, G, 32]
  xg = x.astype(np.int64).reshape(x.shape[0], -1, 32)
  y = np.einsum("mgi,ngi->mng", xg, q) * scale[None].astype(np.float64)
  if offset is not None:
    y = y + xg.sum(-1)[:, None, :] * offset[None].astype(np.float64)
  return y.sum(-1)


def test_q4_packing_round_trips():
  rng = np.random.default_rng(7)
  for K in (32, 64, 96, 160, 512, 544, 1536):
    q = rng.integers(0, 16, (5, K)).astype(np.uint8)
    packed = np.asarray(quant.pack_q4(jnp.asarray(q)))
    np.testing.assert_array_equal(_unpack(packed), q)
    np.testing.assert_array_equal(np.asarray(quant.unpack_q4(jnp.asarray(packed))), q)


@pytest.mark.parametrize("offsets", [False, True], ids=["symmetric", "offsets"])
@pytest.mark.parametrize("M", [1, 2, 5, 6, 9])
@pytest.mark.parametrize("N,K", [(7, 32), (9, 64), (37, 96), (130, 1536), (5, 4864), (3, 544)])
def test_q4_matmul_matches_the_reference(M, N, K, offsets):
  """Every row pass and row block, superblocks whole (K = 0 mod 512) and partial (1, 2, 3, 8 or 1
  groups past the last whole one), thread chunks; both forms (codes - 8, or codes and offsets)."""
  rng = np.random.default_rng(M * 100 + N + K)
  x = rng.standard_normal((M, K)).astype(np.float32)
  codes = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
  scale = rng.random((N, K // 32)).astype(np.float16)
  offset = rng.standard_normal((N, K // 32)).astype(np.float16) if offsets else None
  got = np.asarray(native.q4_matmul(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale),
                                    offset=None if offset is None else jnp.asarray(offset)))
  xq, xs = (np.asarray(a) for a in quant.quantize_rows(jnp.asarray(x)))
  want = _q4_reference(xq, codes, scale, offset) * xs
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # Has teeth: the nibbles read in the other order fail it, and so do offsets taken per group
  # of the other row (each group's own offset is what the kernel must add).
  swapped = (codes >> 4) | (codes << 4)
  assert np.abs(_q4_reference(xq, swapped, scale, offset) * xs - want).max() > 1e-2 * np.abs(
      want).max()
  if offsets and N > 1:
    rolled = np.roll(offset, 1, axis=0)
    assert np.abs(_q4_reference(xq, codes, scale, rolled) * xs - want).max() > 1e-2 * np.abs(
        want).max()


def _q4_1_blocks(rng, rows: int, blocks: int):
  """Raw Q4_1 tensor bytes [rows, blocks * 20] as ggml's quantizer makes them (each block's min
  at code 0, its max at 15), with its codes [rows, blocks * 32], scales and offsets."""
  codes = rng.integers(0, 16, (rows, blocks, 32)).astype(np.uint8)
  codes[..., 0], codes[..., 1] = 0, 15
  codes = np.take_along_axis(codes, rng.permuted(np.tile(np.arange(32), (rows, blocks, 1)),
                                                  axis=-1), -1)
  d = (rng.random((rows, blocks)) * 0.01 + 1e-4).astype(np.float16)
  m = (-rng.random((rows, blocks)) * 0.1).astype(np.float16)
  qs = codes[..., :16] | (codes[..., 16:] << 4)  # low nibbles: the first 16 values
  raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs], -1)
  return raw.reshape(rows, -1), codes.reshape(rows, -1), d, m


def test_q4_keeps_a_gguf_q4_1_block_exactly():
  """--weights q4 of a Q4_1 GGUF (the default model's projections) reads the very codes, scales
  and offsets of the file: dequantized and quantized again, nothing moves (the symmetric form
  lost 0.36 at worst on the default model's wq)."""
  from jspec.io import gguf_file
  rng = np.random.default_rng(11)
  rows, blocks = 24, 18  # K = 576: one whole superblock and 2 groups
  raw, codes, d, m = _q4_1_blocks(rng, rows, blocks)
  w = np.asarray(gguf_file.materialize(jnp.asarray(raw), gguf_file.Q4_1, (rows, blocks * 32),
                                       None, jnp.float32))  # [N, K]: rows are output channels
  q4 = quant.quantize_q4(w.T, (0,))
  np.testing.assert_array_equal(np.asarray(quant.unpack_q4(q4.codes)), codes)
  np.testing.assert_array_equal(np.asarray(q4.scale).view(np.uint16), d.view(np.uint16))
  np.testing.assert_array_equal(np.asarray(q4.offset).view(np.uint16), m.view(np.uint16))
  np.testing.assert_array_equal(np.asarray(q4.dense()), w.T)
  symmetric = np.asarray(quant.quantize_q4(w.T, (0,), offset=False).dense())
  assert np.abs(symmetric - w.T).max() > 1e-4  # has teeth: the other form does not keep them


Q4_PROJECTIONS = [("bte,ehd->bthd", (64, 4, 16), (0,), (2, 3, 64)),
                  ("btf,fe->bte", (96, 48), (0,), (1, 5, 96)),
                  ("bte,ef->btf", (160, 80), (0,), (1, 1, 160))]


@pytest.mark.parametrize("spec,shape,axes,xshape", Q4_PROJECTIONS, ids=[p[0] for p in Q4_PROJECTIONS])
def test_q4_einsum_matches_dequantized_reference(spec, shape, axes, xshape):
  rng = np.random.default_rng(3)
  w = rng.standard_normal(shape).astype(np.float32)
  q4 = quant.quantize_q4(w, axes)
  dense = np.asarray(q4.dense(), np.float64)
  assert dense.shape == shape and np.abs(dense - w).max() <= np.abs(w).max() / 14 + 1e-6
  x = jnp.asarray(rng.standard_normal(xshape).astype(np.float32))
  xq, xs = quant.quantize_rows(x)
  want = np.einsum(spec, np.asarray(xq, np.float64) * np.asarray(xs, np.float64), dense)
  np.testing.assert_allclose(np.asarray(quant.einsum(spec, x, q4)), want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())


def test_q4_reshape_and_refusals():
  rng = np.random.default_rng(4)
  w = rng.standard_normal((4, 16, 64)).astype(np.float32)
  merged = quant.quantize_q4(w, (0, 1)).reshape(64, 64)
  flat = quant.quantize_q4(w.reshape(64, 64), (0,))
  assert merged.shape == flat.shape and merged.in_axes == flat.in_axes
  np.testing.assert_array_equal(np.asarray(merged.codes), np.asarray(flat.codes))
  with pytest.raises(ValueError, match="multiple of 32"):
    quant.quantize_q4(np.ones((48, 8), np.float32), (0,))
  with pytest.raises(ValueError, match="input axes first"):
    quant.quantize_q4(np.ones((8, 64), np.float32), (1,))
  with pytest.raises(ValueError, match="4 bits"):
    quantize_params(init_params(WIDE, jax.random.key(0)), "xla", bits=4)


def test_records_name_the_weight_format():
  """A record of a q4 model says q4 (its embedding is int8: 'int8' was recorded for both)."""
  params = init_params(WIDE, jax.random.key(0))
  assert quant.format_name(params) == "float32"
  assert quant.format_name(native_float_params(params)) == "float32"
  assert quant.format_name(quantize_params(params, "native")) == "int8"
  assert quant.format_name(quantize_params(params, "native", bits=4)) == "q4"


def test_q4_token_bit_identical_alone_or_in_a_block_and_chains_identical():
  from tests.test_quant import _block_and_steps
  base = init_params(WIDE, jax.random.key(2), scale=0.3)
  params = quantize_params(base, "native", bits=4)
  together, alone = _block_and_steps(params, WIDE, block_cache=64, step_cache=128)
  np.testing.assert_array_equal(np.asarray(together), np.asarray(alone))
  noise = init_params(WIDE, jax.random.key(1), scale=0.3)
  noised = jax.tree.map(lambda a, b: a + 0.3 * b if a.ndim > 1 else a, base, noise)
  drafter = ModelDrafter(quantize_params(noised, "native", bits=4), WIDE)
  _chain_matches_generate(params, WIDE, drafter, 3, 47)


# ----------------------------------------------------------------------------- float32 kernel


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 33), (37, 200), (130, 576), (5, 17), (66, 1536)])
def test_f32_linear_matches_the_reference_and_a_row_alone(M, N, K):
  """Against a float64 matmul at every pass width (1-8 rows, then 8 at a time), weight-row blocks
  of 4, 3, 2 and 1, K tails under 16 floats and thread chunks of 32 rows; and each row computed
  alone gives the bits it gets in the block (the fixed summation order greedy identity needs)."""
  rng = np.random.default_rng(M * 1000 + N + K)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = rng.standard_normal((N, K)).astype(np.float32)
  fn = jax.jit(native.f32_linear)
  got = np.asarray(fn(jnp.asarray(x), jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64).T
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
  for m in {0, M // 2, M - 1}:
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x[m:m + 1]), jnp.asarray(w)))[0],
                                  got[m])


def test_f32_linear_gradients_and_refusals():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((9, 40)).astype(np.float32))
  c = jnp.asarray(rng.standard_normal((3, 9)).astype(np.float32))
  got = jax.grad(lambda x, w: jnp.sum(native.f32_linear(x, w) * c), (0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum((x @ w.T) * c), (0, 1))(x, w)
  for g, h in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
    native.f32_linear(x, w[:, :7])
  with pytest.raises(ValueError, match="float32 operands"):
    native.f32_linear(x.astype(jnp.bfloat16), w)
  with pytest.raises(ValueError, match="float32 weights"):
    quant.dense_native(np.ones((4, 4), np.float16), (0,))


@pytest.mark.parametrize("spec,shape,axes,xshape", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_dense_weight_is_the_same_weight(spec, shape, axes, xshape):
  """Stored output-major, a DenseWeight reads as the same weight and its matmul agrees with XLA's
  to float32 rounding."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal(shape).astype(np.float32)
  nat = quant.dense_native(w, axes)
  assert nat.shape == shape and nat.stored.shape[-1] == shape[axes[0]]
  np.testing.assert_array_equal(np.asarray(nat.dense()), w)
  np.testing.assert_array_equal(np.asarray(nat), w)  # __array__: savers and borrowers
  # read as the array by code written for plain weights (training, VocabTrim)
  assert nat.ndim == w.ndim
  np.testing.assert_array_equal(np.asarray(nat.T), w.T)
  np.testing.assert_array_equal(np.asarray(nat[1:3]), w[1:3])
  assert nat.astype(jnp.bfloat16).dtype == jnp.bfloat16
  for rows in (xshape, (1, 5, xshape[-1])):
    x = jnp.asarray(rng.standard_normal(rows).astype(np.float32))
    np.testing.assert_allclose(np.asarray(quant.einsum(spec, x, nat)),
                               np.asarray(jnp.einsum(spec, x, w)), rtol=1e-5, atol=1e-5)
  if axes == (0, 1) or len(shape) == 3:
    return
  if axes == (1,):  # the embedding table: rows read by id
    ids = jnp.asarray([[3, 0, 95]])
    np.testing.assert_array_equal(np.asarray(quant.take_rows(nat, ids)), w[np.asarray(ids)])


def test_dense_weight_reshape_merges_input_axes():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((4, 16, 64)).astype(np.float32)
  nat = quant.dense_native(w, (0, 1)).reshape(64, 64)
  assert nat.stored.shape == (64, 64) and nat.in_axes == (0,)
  np.testing.assert_array_equal(np.asarray(nat.dense()), w.reshape(64, 64))
  with pytest.raises(ValueError, match="keeps the trailing output axes"):
    nat.reshape(32, 128)


@pytest.mark.parametrize("cfg", ["narrow", "wide"])
def test_native_float_token_bit_identical_alone_or_in_a_block(cfg):
  """A float32 model on the native kernels scores a token with the same bits in a block as in a
  one-token step, over caches of other sizes (XLA's float32 dot does not promise it)."""
  from tests.test_quant import TARGET, _block_and_steps
  cfg = TARGET if cfg == "narrow" else WIDE
  params = native_float_params(init_params(cfg, jax.random.key(2), scale=0.3))
  together, alone = _block_and_steps(params, cfg, block_cache=64, step_cache=128)
  np.testing.assert_array_equal(np.asarray(together), np.asarray(alone))


def test_native_float_forward_and_gradients_match_xla():
  params = init_params(WIDE, jax.random.key(2), scale=0.3)
  nat = native_float_params(params)
  tokens, positions = jnp.asarray([PROMPTS[2][:6]]), jnp.arange(6)[None]

  def loss(p):
    logits, _, _ = forward(p, WIDE, tokens, positions, KVCache.init(WIDE, 1, 32))
    return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))  # (eager: 360 programs, one an op)
  (l_nat, logits_nat), g_nat = grad(nat)
  (l_xla, logits_xla), g_xla = grad(params)
  np.testing.assert_allclose(np.asarray(logits_nat), np.asarray(logits_xla), rtol=1e-4,
                             atol=1e-4 * float(jnp.abs(logits_xla).max()))
  g_up = g_nat.layers[1].w_up  # a DenseWeight's cotangent, in its stored layout
  want = np.asarray(g_xla.layers[1].w_up)
  np.testing.assert_allclose(np.asarray(g_up.stored.T), want, rtol=1e-3,
                             atol=1e-3 * np.abs(want).max())
  want = np.asarray(g_xla.layers[0].wq)  # through the attention kernel's gradient
  np.testing.assert_allclose(np.asarray(g_nat.layers[0].wq.dense()), want, rtol=1e-3,
                             atol=1e-3 * np.abs(want).max())


def test_the_float_program_calls_the_kernel():
  """No silent fallback: every projection and the head of a native float32 model is the custom
  call, attention is jspec's, and no float dot is left to XLA."""
  params = native_float_params(init_params(WIDE, jax.random.key(2), scale=0.3))
  args = (WIDE, jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None], KVCache.init(WIDE, 1, 16))
  hlo = jitted_forward.lower(params, *args).as_text()
  assert hlo.count(f"@{native.F32_LINEAR}") >= 7 * WIDE.num_layers + 1
  assert hlo.count(f"@{native.ATTENTION}") == WIDE.num_layers
  assert "dot_general" not in hlo
  plain = jitted_forward.lower(
      init_params(WIDE, jax.random.key(2)), *args).as_text()
  assert native.F32_LINEAR not in plain and "dot_general" in plain  # the check above can see one


def test_native_float_chains_and_trees_are_token_identical():
  from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate
  base = init_params(WIDE, jax.random.key(2), scale=0.3)
  noise = init_params(WIDE, jax.random.key(1), scale=0.3)
  noised = jax.tree.map(lambda a, b: a + 0.3 * b if a.ndim > 1 else a, base, noise)
  target = native_float_params(base)
  drafter = ModelDrafter(native_float_params(noised), WIDE)
  want = _chain_matches_generate(target, WIDE, drafter, 3, 32)
  tree = tree_speculative_generate(target, WIDE, drafter, PROMPTS,
                                   spec=TreeSpecConfig(tree="dynamic:6", max_new_tokens=32))
  assert tree.sequences() == want


def test_float32_formats_choose_their_kernel():
  from jspec.io.load import in_format
  params = init_params(WIDE, jax.random.key(2))
  nat, xla = in_format(params, "float32"), in_format(params, "float32-xla")
  assert isinstance(nat.layers[0].wq, quant.DenseWeight) and isinstance(nat.embed, quant.DenseWeight)
  assert quant.attention_kernel(nat) == "native" and not quant.is_quantized(nat)
  assert xla.layers[0].wq is params.layers[0].wq and quant.attention_kernel(xla) is None


def test_a_float_prefill_past_the_row_limit_runs_xla():
  """Past NATIVE_F32_MAX_ROWS rows (a prefill, compute-bound) the projections are XLA dots; up to
  it (decode steps, verification blocks, trees) they are the kernel."""
  params = native_float_params(init_params(WIDE, jax.random.key(2), scale=0.3))
  limit = quant.NATIVE_F32_MAX_ROWS

  def hlo(T):
    return jitted_forward.lower(
        params, WIDE, jnp.zeros((1, T), jnp.int32), jnp.arange(T)[None],
        KVCache.init(WIDE, 1, 2 * limit + 8)).as_text()

  at, past = hlo(limit), hlo(limit + 1)
  assert at.count(f"@{native.F32_LINEAR}") >= 7 * WIDE.num_layers + 1 and "dot_general" not in at
  assert native.F32_LINEAR not in past and "dot_general" in past


# ------------------------------------------------------------------ a traced layer of stacked weights


def _stacked_cases(rng, M=3, N=37, K=96, L=3):
  """(kernel, per-layer operands, stacked operands) for each kernel that reads a layer."""
  x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
  f32 = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(L)]
  i8 = [(_int8(rng, (N, K)), rng.random(N).astype(np.float32)) for _ in range(L)]
  q4 = [(rng.integers(0, 256, (N, K // 2)).astype(np.uint8),
         rng.random((N, K // 32)).astype(np.float16)) for _ in range(L)]
  stack = lambda layers: tuple(jnp.asarray(np.stack(a)) for a in zip(*layers))
  return x, [(native.f32_linear, [(w,) for w in f32], stack([(w,) for w in f32])),
             (native.int8_linear, i8, stack(i8)), (native.q4_matmul, q4, stack(q4))]


def test_kernels_read_a_traced_layer_of_stacked_weights_in_place():
  """Every kernel given weights stacked on [L] and a layer, traced or not, gives the bits the
  layer's own weights give; a layer out of range is refused (known) or fails the call (traced)."""
  x, cases = _stacked_cases(np.random.default_rng(5))
  for kernel, layers, stacked in cases:
    traced = jax.jit(lambda x, i, *w: kernel(x, *w, layer=i))
    for i, own in enumerate(layers):
      want = np.asarray(kernel(x, *map(jnp.asarray, own)))
      np.testing.assert_array_equal(np.asarray(kernel(x, *stacked, layer=i)), want)
      np.testing.assert_array_equal(np.asarray(traced(x, jnp.int32(i), *stacked)), want)
    with pytest.raises(ValueError, match=r"layer 3 is out of \[0, 3\)"):
      kernel(x, *stacked, layer=3)
    with pytest.raises(Exception, match="layer must be an int32 in"):
      jax.block_until_ready(traced(x, jnp.int32(3), *stacked))
    with pytest.raises(ValueError, match="leading \\[L\\] axis"):
      kernel(x, *map(jnp.asarray, layers[0]), layer=0)


def test_native_attention_reads_a_traced_layer():
  rng = np.random.default_rng(6)
  k, v = (jnp.asarray(rng.standard_normal((3, 1, 20, 2, 16)).astype(np.float32)) for _ in "kv")
  q = jnp.asarray(rng.standard_normal((1, 2, 4, 16)).astype(np.float32))
  visible = jnp.asarray(rng.random((1, 2, 20)) < 0.7)
  traced = jax.jit(native.attention)
  outs = [np.asarray(traced(q, k, v, visible, jnp.int32(i))) for i in range(3)]
  for i in range(3):
    np.testing.assert_array_equal(outs[i], np.asarray(native.attention(q, k, v, visible, i)))
  assert not np.allclose(outs[0], outs[1])
  with pytest.raises(Exception, match="0 <= layer < L"):
    jax.block_until_ready(traced(q, k, v, visible, jnp.int32(3)))
  # The decoder's static layer is checked before the custom_vjp traces it, under jit too.
  from jspec.models.attention import visible_attention
  attend = visible_attention(visible, "native")
  with pytest.raises(ValueError, match=r"layer 3 is out of \[0, 3\)"):
    jax.jit(lambda q, k, v: attend(q, k, v, 3))(q, k, v)


def test_kernel_einsum_takes_zero_rows():
  """A forward asked for logits at no position runs the LM head over zero rows."""
  rng = np.random.default_rng(7)
  w = quant.dense_native(rng.standard_normal((24, 40)).astype(np.float32), (1,))  # [V, E]
  q8 = quant.quantize_int8(rng.standard_normal((40, 24)).astype(np.float32), (0,), "native")
  q4 = quant.quantize_q4(rng.standard_normal((64, 24)).astype(np.float32), (0,))
  x = jnp.zeros((1, 0, 40), jnp.float32)
  assert quant.einsum("...e,ve->...v", x, w).shape == (1, 0, 24)
  assert quant.einsum("...e,ev->...v", x, q8).shape == (1, 0, 24)
  assert quant.einsum("...e,ev->...v", jnp.zeros((1, 0, 64)), q4).shape == (1, 0, 24)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), q4)  # two layers
  assert quant.einsum("...e,ev->...v", jnp.zeros((1, 0, 64)),
                      quant.LayerOf(stacked, jnp.int32(1))).shape == (1, 0, 24)


# A few cases of each kernel test: every kernel, row passes, tails, the fixed summation order.
PORTABLE_CASES = (
    [f"test_int8_matmul_is_exact[{n}-{k}-{m}]" for n, k in ((37, 200), (130, 1536)) for m in (1, 5, 9)]
    + [f"test_q4_matmul_matches_the_reference[{n}-{k}-{m}-{o}]" for n, k in ((130, 1536), (3, 544))
       for m in (1, 9) for o in ("symmetric", "offsets")]
    + [f"test_f32_linear_matches_the_reference_and_a_row_alone[{n}-{k}-{m}]"
       for n, k in ((37, 200), (66, 1536)) for m in (1, 9)]
    + [f"test_int8_linear_quantizes_like_xla[{k}-5]" for k in (16, 37, 200)]
    + ["test_native_attention_matches_the_reference",  # its 4 shapes
       "test_native_float_token_bit_identical_alone_or_in_a_block"])  # narrow and wide
PORTABLE_TESTS = len(PORTABLE_CASES) - 2 + 4 + 2


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux",
                    reason="builds for the x86-64 baseline")
def test_the_portable_code_passes_the_kernel_tests():
  """A CPU without AVX-512 (most AMD and laptop CPUs) compiles the kernels' portable code, which
  this machine's -march=native build never runs: built for the x86-64 baseline, in a process of
  its own (the kernels register under fixed names), the kernel tests must pass there too."""
  root = Path(__file__).resolve().parent.parent
  proc = subprocess.run([sys.executable, str(root / "scripts" / "native_portable.py"), "x86-64",
                         *(f"tests/test_native.py::{c}" for c in PORTABLE_CASES)],
                        cwd=root, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-2000:])
  assert f"{PORTABLE_TESTS} passed" in proc.stdout, proc.stdout[-2000:]
