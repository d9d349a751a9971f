"""Params and cache shard over a (dp, tp) mesh of fake CPU devices and give the same results."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from jspec.generate import generate
    from jspec.models.cache import KVCache, cache_layout
    from jspec.models.config import Config
    from jspec.models.llama import forward, init_params, param_layout
    from jspec.sharding import shard

    assert len(jax.devices()) == 4, jax.devices()
    cfg = Config(arch="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    sharded = shard(params, param_layout(cfg), mesh)
    assert sharded.layers[0].wq.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert len(sharded.layers[1].w_up.addressable_shards) == 4
    assert sharded.layers[1].w_up.addressable_shards[0].data.shape == (64, 64)

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    want, _, _ = forward(params, cfg, tokens, pos, KVCache.init(cfg, 2, 32))
    cache = shard(KVCache.init(cfg, 2, 32), cache_layout(cfg, 2, 32), mesh)
    got, _, _ = jax.jit(forward, static_argnums=1)(sharded, cfg, tokens, pos, cache)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-4  # sharded sums reorder

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    a = generate(params, cfg, prompts, max_new_tokens=6).sequences()
    b = generate(sharded, cfg, prompts, max_new_tokens=6).sequences()
    assert a == b, (a, b)
    print("SHARDING-OK")
""")


def test_sharded_forward_and_generate():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0 and "SHARDING-OK" in result.stdout, result.stderr[-3000:]
