"""Sharded generation on 8 simulated CPU devices: the same tokens as one device for autoregressive,
chain and tree speculative decoding (greedy and sampled, ragged batches) under dp, tp and dp x tp
meshes, one compile per shape, Megatron's communication and no more; and clear errors for meshes
that do not fit. The device count is fixed when JAX starts, so the checks run in a subprocess
(tests/sharding_checks.py)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.generate import generate
from jspec.models.config import Config
from jspec.models.llama import init_params, native_float_params
from jspec.sharding import Placement, make_mesh, model_placement, parse_mesh

CHECKS = Path(__file__).with_name("sharding_checks.py")


def run_checks(*groups: str) -> None:
  """Run check groups of tests/sharding_checks.py in a subprocess that sees 8 CPU devices."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=str(CHECKS.parent.parent))
  result = subprocess.run([sys.executable, str(CHECKS), *groups], env=env, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-4000:]
  for group in groups:
    assert f"{group}-OK" in result.stdout, result.stdout


def test_placement_and_communication_of_a_decode_step():
  run_checks("communication", "rounds", "budget", "compiles", "repeat", "filters")


def test_generate_on_meshes_equals_one_device():
  run_checks("generate", "streams", "penalties")


def test_stacked_layers_on_meshes_equal_one_device():
  run_checks("stacked")


CFG = Config(arch="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1,
             num_heads=6, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("text, want", [("dp=2,tp=4", {"dp": 2, "tp": 4}),
                                        ("tp=8", {"dp": 1, "tp": 8}),
                                        (" dp = 3 ", {"dp": 3, "tp": 1})])
def test_parse_mesh(text, want):
  assert parse_mesh(text) == want


@pytest.mark.parametrize("text", ["", "dp=2,pp=2", "dp=0", "dp=2,dp=2", "tp:4", "dp=two"])
def test_parse_mesh_refuses(text):
  with pytest.raises(ValueError, match="mesh"):
    parse_mesh(text)


def test_a_mesh_larger_than_the_devices_is_refused():
  with pytest.raises(ValueError, match=f"needs {2 * len(jax.devices())} devices.*device_count"):
    make_mesh(dp=2 * len(jax.devices()))


def test_mesh_checks_against_the_model():
  mesh = make_mesh(1, 1)
  fake = lambda dp, tp: type("M", (), {"shape": {"dp": dp, "tp": tp}, "axis_names": ("dp", "tp")})()
  with pytest.raises(ValueError, match=r"tp=4 does not divide the model's attention heads \(6\).*"
                                       r"tp in \[1, 2, 3, 6\]"):
    model_placement(CFG, fake(1, 4))
  assert model_placement(CFG, fake(1, 2)).rules.kv_heads == "tp"  # 2 KV heads split 2 ways
  assert model_placement(CFG, fake(1, 3)).rules.kv_heads is None  # 2 KV heads over 3: replicated
  with pytest.raises(ValueError, match="batch of 3 prompts does not divide .* dp=2"):
    Placement(fake(2, 1)).check_batch(3)
  with pytest.raises(ValueError, match="axes"):
    model_placement(CFG, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
  assert model_placement(CFG, mesh).tp == 1


def test_native_kernel_weights_are_refused_on_a_mesh():
  params = native_float_params(init_params(CFG, jax.random.key(0)))
  with pytest.raises(ValueError, match="DenseWeight.*not placed on a mesh.*float32-xla"):
    generate(params, CFG, [[1, 2]], max_new_tokens=2, mesh=make_mesh(1, 1))


def test_get_rows_and_set_rows_index_each_rows_own_entries():
  from jspec.sharding import get_rows, set_rows
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 7, 4)).astype(np.float32)  # batch axis 1
  idx = np.array([[0, 6, 2], [5, 4, 1], [3, 7, 0]])  # 7: past the axis (no row repeats an index)
  want = np.stack([x[:, b, np.minimum(idx[b], 6)] for b in range(3)], axis=1)
  np.testing.assert_array_equal(get_rows(x, np.minimum(idx, 6), axis=1), want)
  value = rng.normal(size=(2, 3, 3, 4)).astype(np.float32)
  got = np.asarray(set_rows(jnp.asarray(x), idx, value, axis=1, mode="drop"))
  want = x.copy()
  for b in range(3):
    for j, i in enumerate(idx[b]):
      if i < 7:
        want[:, b, i] = value[:, b, j]
  np.testing.assert_array_equal(got, want)
  flags = np.asarray(set_rows(jnp.zeros((3, 5), bool), idx[:, :2], True, mode="drop"))
  assert flags.tolist() == [[True, False, False, False, False], [False, False, False, False, True],
                            [False, False, False, True, False]]  # 5 and past it: dropped
