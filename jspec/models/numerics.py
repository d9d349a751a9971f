"""How the decoding programs are compiled so that a token is scored with the same bits whichever
program scores it: a one-token step of autoregressive decoding, or a row of a speculative
verification block, over a KV cache of any size.

Greedy speculative decoding is token-identical to autoregressive decoding only if the target's
argmax at each position does not depend on the program that computed it. Float32 weights tolerate
last-bit differences (they almost never move an argmax); int8 weights do not, because every
activation is re-quantized to int8 and a last-bit difference can move a value across a rounding
boundary, one whole quantization step. Four things make the bits program-independent:

- matmuls of int8 weights are int8 x int8 -> int32 (exact) with per-token activation scales
  (`quant.einsum`); attention sums over a token's visible slots in an order nothing else changes
  (`jspec.native.attention` on CPU; with XLA's int8 dot, one query token at a time,
  `attention.masked_attention(per_token=True)`);
- sums over a row run in one fixed order that zeros appended to the row do not change
  (`row_sum`: RMSNorm, the softmax, and q . k, whose XLA dot picked its order by the cache
  size on an AVX2 CPU), so a softmax over a 320-slot cache equals one over 256 slots;
- int8 scales have 17 significant bits (`quant.exact_product_scale`), so a code times its scale
  is exact in float32 and rounds alike whether XLA:CPU fuses it into a following add as an FMA
  or not (it did for an embedding row and layer 0's residual add, in some programs only);
- XLA:CPU's YNNPACK is limited to plain dots: XLA hands a reduction and its elementwise
  neighbours (max, subtract, exp) to YNNPACK for some shapes and emits them itself for others,
  and the two `exp` implementations differ in the last bit, so the choice depended on the cache
  size. (Turning YNNPACK off entirely makes int8 decoding ~3.5x slower: its int8 dots are fast.)

Precision (`matmul_precision(name)`, every engine's `precision=` argument, the CLI's `--precision`):
"fast" (the default) leaves float32 matmuls at the backend's default, which on GPUs is TF32 and on
TPUs bfloat16 passes, ~1e-3 relative error: a verification block and a one-token step then round
differently and greedy speculative output can part from greedy autoregressive output at near
ties. "exact" traces every matmul (model, attention, the Pallas kernels' float32 paths) at full
float32 precision, so they round alike to ~1e-7: the mode for token-identical greedy output. On
CPU both are full precision (the option only marks the program).

Every engine's `jax.jit` passes COMPILER_OPTIONS. If you jit jspec's pure functions
(`generate_tokens`, `speculative_generate_tokens`) yourself, pass them too:
`jax.jit(fn, compiler_options=COMPILER_OPTIONS, ...)` on CPU. They are debug options of the CPU
backend, so the engines pass them only to calls that run on the CPU, and only where this
jaxlib knows the option (older ones, without YNNPACK fusions, do not need it).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

Array = jax.Array

COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
PRECISIONS = ("fast", "exact")


def row_sum(x: Array) -> Array:
  """Sum over the last axis [..., N] -> [..., 1] in one fixed order whatever the leading shape:
  zero-padded to a power of two, then pairwise halving. XLA's reductions pick their order by
  shape, so a token's sum could differ in its last bit between a one-token step and a
  verification block. The padding makes the order also independent of N when the tail is zeros:
  a softmax over a cache of 320 slots sums its 150 visible ones exactly as one over 256 slots
  does (the first halvings only add zeros), so a bigger cache does not change a single bit."""
  n = x.shape[-1]
  width = 1 << (n - 1).bit_length()  # the power of two >= n
  if width != n:
    x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], width - n), x.dtype)], axis=-1)
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x


def precision_label() -> str:
  """The matmul precision programs are traced at now, as benchmark records state it: "highest"
  under exact (or a global JAX_DEFAULT_MATMUL_PRECISION), "default" for the backend's own."""
  return str(jax.config.jax_default_matmul_precision or "default")


@contextlib.contextmanager
def matmul_precision(name: str):
  """Trace the programs inside at this precision ("fast" or "exact", see the module doc). "fast"
  leaves the matmul precision as it is (so a global JAX_DEFAULT_MATMUL_PRECISION still holds)."""
  if name not in PRECISIONS:
    raise ValueError(f"precision must be 'fast' (the backend's default matmul precision: TF32 on "
                     f"GPUs) or 'exact' (full float32 matmuls: token-identical greedy speculative "
                     f"decoding on accelerators), got {name!r}")
  if name == "exact":
    with jax.default_matmul_precision("highest"):
      yield
  else:
    yield


@functools.cache
def _cpu_knows_options() -> bool:
  try:
    jax.jit(lambda x: x + 1, compiler_options=COMPILER_OPTIONS).lower(1.0).compile()
    return True
  except Exception as e:  # a jaxlib without the option; anything else is not for us to hide
    if "compile option" not in str(e):
      raise
    return False


def cpu_compiler_options() -> dict:
  """COMPILER_OPTIONS where this jaxlib knows them, else {}: what to pass `jax.jit` for a program
  that runs on the CPU, compiled as the engines compile theirs."""
  return dict(COMPILER_OPTIONS) if _cpu_knows_options() else {}


def _platform(args) -> str | None:
  """Where a call runs: the platform of its first committed array (placed with device_put),
  else the default device's (`jax.default_device`), else the default backend; None when called
  inside another trace (a user's jit or vmap), whose own top-level jit compiles the program."""
  leaves = jax.tree.leaves(args)
  if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return None
  for leaf in leaves:
    if isinstance(leaf, jax.Array) and leaf.committed:
      return next(iter(leaf.devices())).platform
  default = jax.config.jax_default_device
  if default is not None:
    return default if isinstance(default, str) else default.platform
  return jax.default_backend()


def node_classes(tree) -> tuple[type, ...]:
  """The class of every node of a pytree's structure, depth first."""
  classes, stack = [], [jax.tree.structure(tree)]
  while stack:
    treedef = stack.pop()
    data = treedef.node_data()
    if data is not None:
      classes.append(data[0])
    stack.extend(treedef.children())
  return tuple(classes)


def engine_jit(fn, keyed_by_class: tuple[int, ...] = (), **kwargs):
  """jax.jit(fn, **kwargs), with COMPILER_OPTIONS where the call runs on the CPU, traced at the
  call's `precision=` ("fast" or "exact"): how every decoding program is compiled. Where it runs
  is read at each call (cheap: arrays placed on the CPU while the default backend is a GPU get
  the options too), not at import, so importing jspec does not initialize JAX.

  `keyed_by_class`: positional arguments whose pytree node classes join the compiled program's
  key (a static argument). jaxlib 0.10.2 compares register_dataclass treedefs without their
  classes or field names, so a drafter subclass that only overrides methods flattens "equal" to
  its parent, and jit could run the parent's program for it (seen: 102 of 600 such classes)."""
  traced = fn
  if keyed_by_class:
    def keyed(classes, *args, **kw):
      return fn(*args, **kw)
    keyed.__name__ = keyed.__qualname__ = fn.__name__  # the program's name in HLO and profiles
    traced = keyed
    kwargs["static_argnums"] = (0, *(i + 1 for i in kwargs.get("static_argnums", ())))
    if "donate_argnums" in kwargs:
      kwargs["donate_argnums"] = tuple(i + 1 for i in kwargs["donate_argnums"])
  with_options = jax.jit(traced, compiler_options=COMPILER_OPTIONS, **kwargs)
  plain = jax.jit(traced, **kwargs)

  @functools.wraps(fn)
  def run(*args, precision: str = "fast", **kw):
    cpu = _platform((args, kw)) == "cpu" and _cpu_knows_options()
    if keyed_by_class:
      args = (node_classes([args[i] for i in keyed_by_class]), *args)
    with matmul_precision(precision):
      return (with_options if cpu else plain)(*args, **kw)

  run.keyed_by_class = keyed_by_class
  return run
