"""Tree attention in the model: one forward over a token tree gives, at every node, the logits of a
plain causal forward over that node's root-to-node path (ragged prefixes, batch > 1), with the
XLA attention and with the Pallas kernel (interpreted on CPU) behind `attention_impl`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.cache import KVCache
from jspec.models.config import Config
from jspec.models.llama import forward, init_params

CFG = Config(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
S = 64  # cache slots


PATH = 32  # a prompt and a root-to-node path, padded (causal: the padding comes after)


@functools.partial(jax.jit, static_argnums=1)
def causal_logits(params, cfg, tokens):
  """A plain causal forward's logits [1, PATH, V] over tokens [1, PATH] (one program for every
  path: op by op, each path length compiled its own ~30 small programs)."""
  return forward(params, cfg, tokens, jnp.arange(PATH)[None], KVCache.init(cfg, 1, S))[0]


def random_tree(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
  """Parents [n] (-1 = child of the root, parent < node) and depths [n] (root children: 1)."""
  parents = np.array([rng.integers(-1, i) for i in range(n)])
  depth = np.zeros(n, np.int32)
  for i, p in enumerate(parents):
    depth[i] = 1 if p < 0 else depth[p] + 1
  return parents, depth


def ancestor_or_self(parents: np.ndarray) -> np.ndarray:
  n = len(parents)
  mask = np.eye(n, dtype=bool)
  for i in range(n):
    j = parents[i]
    while j >= 0:
      mask[i, j] = True
      j = parents[j]
  return mask


def path(parents: np.ndarray, node: int) -> list[int]:
  out = []
  while node >= 0:
    out.append(node)
    node = parents[node]
  return out[::-1]


def prefill(params, cfg, prompts):
  B = len(prompts)
  P = max(len(p) for p in prompts)
  tokens = np.zeros((B, P), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, : len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  cache = KVCache.init(cfg, B, S)
  _, _, cache = forward(params, cfg, jnp.asarray(tokens),
                        jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), cache)
  return cache.with_lengths(lengths)


@pytest.mark.parametrize("impl", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("n_nodes", [8, 16])
def test_tree_forward_equals_path_forwards(impl, n_nodes):
  cfg = dataclasses.replace(CFG, attention_impl=impl)
  params = init_params(cfg, jax.random.key(0), scale=0.3)
  rng = np.random.default_rng(n_nodes)
  prompts = [list(rng.integers(0, 64, 9)), list(rng.integers(0, 64, 3)), [5]]
  B = len(prompts)
  cache = prefill(params, cfg, prompts)
  if impl != "xla":  # slots the kernel must never read
    k = cache.k.at[:, :, :].set(jnp.where(
        jnp.arange(S)[None, None, :, None, None] >= cache.lengths[None, :, None, None, None],
        jnp.nan, cache.k))
    cache = dataclasses.replace(cache, k=k, v=jnp.where(jnp.isnan(k), jnp.nan, cache.v))
  trees = [random_tree(rng, n_nodes) for _ in range(B)]
  tokens = jnp.asarray(rng.integers(0, 64, (B, n_nodes)), jnp.int32)
  lengths = np.asarray(cache.lengths)
  positions = jnp.asarray(np.stack([lengths[b] + d - 1 for b, (_, d) in enumerate(trees)]))
  mask = jnp.asarray(np.stack([ancestor_or_self(p) for p, _ in trees]))
  logits, _, _ = jax.jit(forward, static_argnums=1)(params, cfg, tokens, positions, cache, mask)
  assert np.isfinite(np.asarray(logits)).all()
  ref_cfg = dataclasses.replace(CFG, attention_impl="xla")
  for b, (parents, _) in enumerate(trees):
    for node in rng.choice(n_nodes, 4, replace=False):
      seq = prompts[b] + [int(tokens[b, j]) for j in path(parents, node)]
      want = causal_logits(params, ref_cfg, jnp.asarray([seq + [0] * (PATH - len(seq))]))
      np.testing.assert_allclose(np.asarray(logits[b, node]), np.asarray(want[0, len(seq) - 1]),
                                 rtol=2e-4, atol=2e-4)


def test_attention_impl_is_validated():
  with pytest.raises(ValueError, match="attention_impl"):
    dataclasses.replace(CFG, attention_impl="flash")
  cfg = dataclasses.replace(CFG, attention_impl="pallas-interpret")
  params = init_params(cfg, jax.random.key(0))
  with pytest.raises(ValueError, match="multiple of 16"):
    forward(params, cfg, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
            KVCache.init(cfg, 1, 40))
  if jax.default_backend() == "cpu":  # no compiled kernel here, and no silent fallback to XLA
    with pytest.raises(ValueError, match="interpret=True"):
      forward(params, dataclasses.replace(CFG, attention_impl="pallas"),
              jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), KVCache.init(cfg, 1, 64))
