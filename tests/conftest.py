"""Suite-wide fixtures."""

import gc
import os

import jax
import pytest

# Tests run in-process CLI commands, which turn JAX's persistent compilation cache on; kept off so
# that no test reads programs another run wrote (test_compilation_cache turns it on in a subprocess).
os.environ["JSPEC_COMPILATION_CACHE"] = "off"


def pytest_configure(config):
  """On an accelerator the suite runs in jspec's exact precision (jspec.models.numerics): its
  parity checks hold float32 to float32 tolerances, which TF32 / bfloat16 matmul passes (the fast
  default there) do not meet. On CPU both precisions compute alike and nothing is changed.
  tests/test_numerics.py checks what each precision traces, whatever this sets."""
  if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop jax's compiled programs after each test module.

  The suite compiles hundreds of XLA CPU programs in one process; kept alive they accumulate
  memory mappings, and late in the full run (jax 0.10.2) XLA's compiler segfaulted in whichever
  tree-engine test came next, while each file passes alone. Tests that check recompilation do so
  within one module, so clearing between modules changes no assertion.
  """
  yield
  jax.clear_caches()
  gc.collect()
