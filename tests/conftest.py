"""Suite-wide fixtures."""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

# Tests run in-process CLI commands, which turn jspec's persistent compilation cache on; kept off so
# that no test reads programs another run wrote (test_compilation_cache turns it on in a subprocess).
os.environ["JSPEC_COMPILATION_CACHE"] = "off"

# One compilation cache for this run alone: a fresh directory made by the first process (the xdist
# controller, or a plain run) and removed when it exits; workers, subprocesses and notebook kernels
# inherit it (JAX reads JAX_COMPILATION_CACHE_DIR). Files compile the same programs again (each
# module's programs are dropped after it, see below; the AR baselines of the greedy-identity tests
# recur across files), and a program is loaded the second time. Nothing outlives the run, so no
# test reads what another run wrote; CompileCounter counts loads as compiles, so the no-recompile
# checks are unchanged.
if "JSPEC_TEST_XLA_CACHE" not in os.environ:
  os.environ["JSPEC_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jspec-test-xla-")
  atexit.register(shutil.rmtree, os.environ["JSPEC_TEST_XLA_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JSPEC_TEST_XLA_CACHE"]
jax.config.update("jax_compilation_cache_dir", os.environ["JSPEC_TEST_XLA_CACHE"])
# Every program, however fast it compiled (JAX keeps those of >= 1 s by default): most of the
# suite's programs take 0.1-1 s and recur across files, workers and subprocesses. Measured on the
# 2-core VM, four engine files (penalties, logprobs, per-row sampling, tree engine; 2 workers):
# 354 -> 302 s.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# Compiling, not running, is most of the suite's time on a CPU, and most of a compile is LLVM
# optimising the generated code. JAX's jax_disable_most_optimizations sets XLA's backend (LLVM)
# optimisation level to 0: the HLO programs are the same (fusion, layout and simplification still
# run), the machine code is not, and its rounding differs in the last bits (the default model's
# logits by up to 1e-4 of ~20, the same greedy tokens): every comparison a test makes is between
# programs compiled alike, so each check keeps its meaning, and the real-model integration file
# (OPTIMISED_FILES) still compiles at full optimisation, as a user's run does (but for the
# emitters, below). Measured on the 2-core VM: a fresh clone's suite 33:44 -> 23:24 with the
# notebooks' trims; tests/test_speculative.py 137 -> 89 s.
# Set before the first compile and in the environment, so subprocesses and notebook kernels
# inherit it. JSPEC_TEST_XLA_OPTIMIZE=1 compiles everything as users do; an accelerator's suite
# always does (its code generation is what a GPU run is there to test). Files whose time is running
# rather than compiling compile at full optimisation too: tests/test_tree_verify.py simulates 20k
# rows per program (one worker's file time, session 39: 199 s at level 0, 124 s optimised; every
# other file was slower optimised, the whole suite 29 -> 42 minutes).
OPTIMISED_FILES = {"test_default_model.py", "test_tree_verify.py"}
AS_USERS = os.environ.get("JSPEC_TEST_XLA_OPTIMIZE") == "1"

# XLA's CPU code generation, the part of a compile that level 0 leaves: its legacy elemental
# emitters build a fusion's LLVM IR faster than the MLIR fusion emitters (XLA's default), and one
# LLVM module a program (no parallel split) does not fight the other worker for the two cores.
# Again the same HLO programs, other machine code, and every comparison between programs compiled
# alike. Measured on the 2-core VM: the whole suite (2 workers) 31:12 -> 17:36; alone,
# tests/test_kv.py 171 -> 114 s, one chain engine's compile 1.9 -> 1.0 s, the OPTIMISED_FILES
# 119 -> 113 s (they compile with these emitters too).
# XLA aborts the process on a flag it does not know, so a child process tries them first (once:
# xdist's workers, subprocesses and notebook kernels inherit the environment); a jaxlib without
# them runs the suite as before, and says so. CPU flags: an accelerator's programs never read them.
SUITE_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"


def _xla_accepts(flags: str) -> bool:
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}",
             JAX_PLATFORMS="cpu")
  probe = "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"
  return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if not AS_USERS and "JSPEC_TEST_XLA_FLAGS" not in os.environ:
  accepted = _xla_accepts(SUITE_XLA_FLAGS)
  os.environ["JSPEC_TEST_XLA_FLAGS"] = SUITE_XLA_FLAGS if accepted else ""
  if accepted:  # before this process's backend starts (jax.default_backend() below)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()
  else:
    print(f"tests/conftest.py: this jaxlib refuses {SUITE_XLA_FLAGS}; compiling with XLA's "
          "default CPU emitters (the suite runs slower)", file=sys.stderr)
LOW_OPT = not AS_USERS and jax.default_backend() == "cpu"
if LOW_OPT:
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True, scope="module")
def _compile_level(request):
  """OPTIMISED_FILES compile at XLA's full optimisation (the compile options are part of the
  compilation cache's key, and each module's programs are dropped after it)."""
  full = LOW_OPT and request.path.name in OPTIMISED_FILES
  if full:
    jax.config.update("jax_disable_most_optimizations", False)
  yield
  if full:
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture
def optimised():
  """One test compiled at XLA's full optimisation, as users' programs are: for what LLVM's
  optimiser changes (it contracts a multiply and an add into an FMA, level 0 does not)."""
  if not LOW_OPT:
    yield
    return
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)


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


# `python -m pytest -m "not slow"`: the core checks in about 2 minutes on 2 cores (README): model
# parity and loading, the engines' greedy identity (chains and trees), the verification rules and
# their mutation controls, tree structure and attention, the kernels' reference parity, the CLI's
# errors. Everything else is `slow` (the real default model, the statistical losslessness tests,
# every drafter family's own file, KV budgets, multi-device runs, training, notebooks, benchmark
# commands). CI runs everything.
CORE_FILES = {"test_models.py", "test_generate.py", "test_speculative.py", "test_tree_engine.py",
              "test_tree_verify.py", "test_tree_forward.py", "test_tree_attention.py",
              "test_tree_structure.py", "test_verify.py", "test_key_similarity.py",
              "test_losses.py", "test_gamma.py", "test_kernel_bench.py", "test_cli.py",
              "test_numerics.py", "test_gguf_file.py", "test_ggufutil.py", "test_architecture.py",
              "test_train_prompts.py", "test_data.py", "test_loading_errors.py",
              "test_tokenizer.py", "test_bench.py", "test_sampling_mode.py", "test_docs.py"}
SLOW_NAMES = ("sampling_is_lossless", "sampled", "distribution", "_law", "test_bench_",
              "test_int8_weights", "mask_token_probing",
              "layer_skipping", "gamma_auto", "second_run_compiles_nothing", "a_tree_prints",
              "under_a_kv_budget", "test_scan_layers")


# Files that take a worker longest (seconds of one worker in a full run on 2 cores, session 53,
# after its trims), sent to the workers first (addopts has --no-loadscope-reorder, which keeps this
# order; xdist's own order, by number of tests, started the notebooks last and left one core idle
# for minutes).
LONGEST_FILES = ("test_kv.py", "test_sharding.py", "test_notebooks.py", "test_cli.py",
                 "test_quant.py", "test_notebooks_more.py", "test_tree_engine.py",
                 "test_logprobs.py", "test_penalties.py", "test_per_row_sampling.py",
                 "test_tree_verify.py", "test_sharding_spec.py", "test_train.py", "test_confu.py",
                 "test_paired_tau.py", "test_native.py", "test_ngram.py", "test_drafters.py",
                 "test_speculative.py", "test_probe.py", "test_default_model.py",
                 "test_scan_layers.py", "test_eagle3.py")


def _longest_first(item) -> int:
  name = item.path.name
  return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
  items.sort(key=_longest_first)  # stable: each file's tests keep their order
  for item in items:
    name = item.name.split("[")[0]
    if (item.path.name not in CORE_FILES or any(part in name for part in SLOW_NAMES)
        or item.name == "test_tree_forward_equals_path_forwards[8-xla]"):
      item.add_marker(pytest.mark.slow)
