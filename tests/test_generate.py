"""generate: greedy equals a cache-free reference, batching is transparent, sampling is processed
correctly, repeated calls do not recompile, and bad input is refused clearly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.decode import PAD, prompt_bucket
from jspec.generate import generate, generate_tokens
from jspec.models.cache import KVCache
from jspec.models.llama import (check_params, forward, init_params, native_float_params,
                                quantize_params, stack_layers)
from jspec.bench.profiling import CompileCounter
from jspec.bench.programs import lower_decode
from jspec.sampling import processing
from jspec.sampling.processing import SamplingParams, processed_logprobs
from tiny_models import SMALL

CFG = SMALL


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


def reference_greedy(params, prompt, n):
  """Greedy decoding by re-running the whole sequence each step (no cache reuse). The sequence is
  padded to its final length so one compiled forward serves every step: attention is causal, so
  the padding after position t cannot change the logits at t."""
  size = len(prompt) + n
  run = jax.jit(lambda p, tokens: forward(p, CFG, tokens, jnp.arange(size)[None],
                                          KVCache.init(CFG, 1, size))[0])
  seq = list(prompt)
  for _ in range(n):
    logits = run(params, jnp.asarray([seq + [0] * (size - len(seq))]))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


PROMPTS = [[5, 17, 3, 44, 2, 9, 61], [8, 1], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]]


def test_greedy_matches_reference(params):
  out = generate(params, CFG, [PROMPTS[0]], max_new_tokens=12)
  assert out.sequences()[0] == reference_greedy(params, PROMPTS[0], 12)
  assert int(out.target_calls) == 12 and int(out.steps) == 11


def test_batch_equals_single(params):
  batch = generate(params, CFG, PROMPTS, max_new_tokens=10).sequences()
  for p, got in zip(PROMPTS, batch):
    assert got == generate(params, CFG, [p], max_new_tokens=10).sequences()[0]
  assert len({tuple(s) for s in batch}) == 3  # the rows really differ


def test_stop_ids_end_rows(params):
  free = generate(params, CFG, PROMPTS, max_new_tokens=10)
  seqs = free.sequences()
  stop = seqs[0][3]  # row 0 stops at its 4th token
  out = generate(params, CFG, PROMPTS, max_new_tokens=10, stop_ids=[stop])
  for b, s in enumerate(seqs):
    cut = s.index(stop) + 1 if stop in s else len(s)
    assert out.sequences()[b] == s[:cut]
    assert int(out.lengths[b]) == cut
    assert np.all(np.asarray(out.tokens[b, cut:]) == PAD)


def test_recorded_top_k_past_a_rows_length_is_padding(params):
  """A finished row's model keeps running beside the others: its top-k there is no distribution
  of its text and must read as padding (PAD, -inf), like its tokens."""
  free = generate(params, CFG, PROMPTS, max_new_tokens=10, record_top_k=3)
  stop = free.sequences()[0][3]
  out = generate(params, CFG, PROMPTS, max_new_tokens=10, stop_ids=[stop], record_top_k=3)
  lengths = np.asarray(out.lengths)
  assert lengths.min() < 10 and lengths.max() > lengths.min()  # a row ended while others ran
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(out.top_ids[b, :n], free.top_ids[b, :n])
    np.testing.assert_allclose(out.top_logprobs[b, :n], free.top_logprobs[b, :n], rtol=1e-6)
    assert (np.asarray(out.top_ids[b, n:]) == PAD).all()
    assert np.isneginf(np.asarray(out.top_logprobs[b, n:])).all()


def test_sampling_is_deterministic_per_key(params):
  sp = SamplingParams(temperature=1.0)
  a = generate(params, CFG, PROMPTS, max_new_tokens=8, sampling=sp, key=3).sequences()
  b = generate(params, CFG, PROMPTS, max_new_tokens=8, sampling=sp, key=3).sequences()
  c = generate(params, CFG, PROMPTS, max_new_tokens=8, sampling=sp, key=4).sequences()
  assert a == b and a != c


def numpy_processed(logits, t, k, p, min_p=0.0):
  """Reference: temperature, then keep the top-k, then the smallest top set of mass >= p, then
  the tokens at least min_p times as likely as the most likely one (transformers' order)."""
  x = logits / t
  order = np.argsort(-x)
  keep = np.zeros_like(x, bool)
  keep[order[: (k or len(x))]] = True
  probs = np.exp(x - x.max()) * keep
  probs /= probs.sum()
  mass = 0.0
  final = np.zeros_like(keep)
  for i in order:
    if not keep[i] or mass >= p:
      break
    final[i] = True
    mass += probs[i]
  out = np.where(final, probs, 0)
  out /= out.sum()
  return np.where(out >= min_p * out.max(), out, 0) / out[out >= min_p * out.max()].sum()


@pytest.mark.parametrize("t,k,p,m", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0),
                                     (0.5, 10, 0.6, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.02),
                                     (0.7, 8, 0.95, 0.3), (1.0, 0, 0.9, 0.3)])
@pytest.mark.parametrize("traced_mode", [False, True])
def test_processed_distribution(t, k, p, m, traced_mode):
  logits = np.random.default_rng(0).normal(size=(3, 40)).astype(np.float32) * 2
  sp = SamplingParams(t, k, p, m, mode=None if traced_mode else "auto")
  got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), sp)))
  kept = []
  for row in range(3):
    want = numpy_processed(logits[row].astype(np.float64), t, k, p, m)
    np.testing.assert_allclose(got[row], want, atol=1e-5)
    kept.append(((want > 0).sum(), (numpy_processed(logits[row].astype(np.float64), t, k, p)
                                     > 0).sum()))
  if m:  # min-p removed tokens the other filters kept
    assert any(with_min_p < without for with_min_p, without in kept), kept


@pytest.mark.parametrize("t,k,p", [(0.3, 5, 1.0), (0.3, 0, 0.6), (1.0, 0, 0.95), (0.7, 40, 0.9),
                                   (1.0, 16, 1.0)],
                         ids=["top-k", "small-nucleus", "nucleus-past-m", "k-past-m", "k-is-m"])
def test_filters_use_the_largest_values_and_bisect_only_past_them(monkeypatch, t, k, p):
  """top-k/top-p look at the 16 largest logits here (CANDIDATES patched down): a filter that
  fits in them (k <= 16, a nucleus of <= 16 tokens) is exact from them alone, one that reaches
  past them (k = 40; a flat row's 0.95 nucleus) falls back to the bisection, exact too."""
  monkeypatch.setattr(processing, "CANDIDATES", 16)
  logits = np.random.default_rng(1).normal(size=(4, 1000)).astype(np.float32) * 2
  logits[1] *= 4  # a peaked row beside flat ones
  got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), SamplingParams(t, k, p))))
  for row in range(4):
    want = numpy_processed(logits[row].astype(np.float64), t, k, p)
    np.testing.assert_allclose(got[row], want, atol=1e-5)
  x = jnp.asarray(logits) / t
  fits = np.asarray(processing.candidate_threshold(x, jnp.full((4, 1), k), jnp.full((4, 1), p))[1])
  assert fits.all() == (k <= 16 and (k > 0 or p < 0.9)), fits  # bisected only past them
  if (k, p) == (0, 0.95):  # the flat rows' nuclei really are larger than the candidates
    assert min((got[row] > 0).sum() for row in (0, 2, 3)) > 16


def kept_by_sorting(x, k, p):
  """float64 reference of the filters' kept set (ties kept) and, per row, how far the nucleus's
  last decision lies from p (a float32 sum may decide a token that close either way)."""
  keep, margin = np.zeros(x.shape, bool), np.full(x.shape[0], np.inf)
  for r, row in enumerate(x.astype(np.float64)):
    finite = row[np.isfinite(row)]
    desc = np.sort(finite)[::-1]
    if k:  # top-k keeps its k largest and every value tied with the k-th
      desc = desc[desc >= desc[min(k, len(desc)) - 1]]
    probs = np.exp(desc - desc.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    n = max(1, int((before < p).sum())) if p < 1 else len(desc)
    keep[r] = np.isfinite(row) & (row >= desc[n - 1])
    if p < 1:
      margin[r] = np.abs(before - p).min()
  return keep, margin


@pytest.mark.parametrize("case", ["flat", "peaked", "ties", "masked"])
def test_bisected_threshold_keeps_what_sorting_keeps(case):
  """The fallback past the candidates bisects the float range for the threshold instead of
  sorting: the same kept set as sorting in float64 on rows with ties, -inf entries (masked
  vocabulary), k past the vocabulary and top-p 1; a row may differ only where the nucleus's edge
  lies within float32 rounding of p."""
  rng = np.random.default_rng(["flat", "peaked", "ties", "masked"].index(case))
  x = rng.normal(size=(8, 700)) * {"flat": 0.3, "peaked": 6.0}.get(case, 2.0)
  if case == "ties":
    x = np.round(x * 2) / 2
  if case == "masked":
    x[:, rng.choice(700, 300, replace=False)] = -np.inf
  x = x.astype(np.float32)
  log_z = jax.nn.logsumexp(jnp.asarray(x), axis=-1, keepdims=True)
  bisect = jax.jit(processing.bisected_threshold)
  for k in (0, 1, 3, 40, 700, 705):
    for p in (0.05, 0.5, 0.9, 1.0):
      if (k, p) == (0, 1.0):
        continue
      threshold = bisect(jnp.asarray(x), jnp.full((8, 1), k), jnp.full((8, 1), p, jnp.float32),
                         log_z)
      got = np.isfinite(x) & (x >= np.asarray(threshold))
      want, margin = kept_by_sorting(x, k, p)
      differ = (got != want).any(axis=-1)
      assert (margin[differ] < 1e-5).all(), (k, p, np.flatnonzero(differ), margin[differ])


@pytest.mark.parametrize("candidates", [256, 2], ids=["candidates", "bisection"])
def test_top_p_reads_every_token_top_k_kept(monkeypatch, candidates):
  """Ties with top-k's k-th value are kept, and top-p then normalises over all of them (it read
  exactly k: [3, 2, 2] at k=2 gave the 3 a mass of 0.73, past top_p 0.7, and kept it alone;
  over the three it is 0.58, so the tied 2s stay)."""
  monkeypatch.setattr(processing, "CANDIDATES", candidates)
  x = jnp.asarray([[3.0, 2.0, 2.0, -4.0]])
  got = np.exp(np.asarray(processed_logprobs(x, SamplingParams(1.0, top_k=2, top_p=0.7))))[0]
  want = np.exp([3.0, 2.0, 2.0]) / np.exp([3.0, 2.0, 2.0]).sum()
  np.testing.assert_allclose(got, [*want, 0.0], atol=1e-6)
  # Past top-p's threshold the ties are all kept too (transformers keeps those first in its sort).
  got = np.exp(np.asarray(processed_logprobs(x, SamplingParams(1.0, top_k=2, top_p=0.6))))[0]
  np.testing.assert_allclose(got, [*want, 0.0], atol=1e-6)
  got = np.exp(np.asarray(processed_logprobs(x, SamplingParams(1.0, top_k=2, top_p=0.5))))[0]
  np.testing.assert_allclose(got, [1.0, 0.0, 0.0, 0.0], atol=1e-6)


def test_a_temperature_below_a_millionth_is_that_temperature():
  """A positive temperature divides as given (one below 1e-6 was raised to it silently)."""
  x = jnp.asarray([[1.0, 1.0 + 2e-6, 0.0]])
  got = np.exp(np.asarray(processed_logprobs(x, SamplingParams(temperature=1e-8))))[0]
  np.testing.assert_allclose(got, [0.0, 1.0, 0.0], atol=1e-6)


def test_first_token_follows_processed_distribution(params):
  """Sampled first tokens (vmap over keys) match the processed distribution (chi-square)."""
  sp = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
  prompt = jnp.asarray([PROMPTS[0] + [0] * 9])
  lengths = jnp.asarray([len(PROMPTS[0])])
  run = jax.jit(jax.vmap(lambda key: generate_tokens(
      params, CFG, prompt, lengths, key, sp, max_new_tokens=1, cache_size=64).tokens[0, 0]))
  n = 20000
  draws = np.asarray(run(jax.random.split(jax.random.key(0), n)))
  cache = KVCache.init(CFG, 1, 16)
  logits, _, _ = forward(params, CFG, jnp.asarray([PROMPTS[0]]),
                         jnp.arange(len(PROMPTS[0]))[None], cache)
  probs = np.exp(np.asarray(processed_logprobs(logits[0, -1], sp), np.float64))
  support = probs > 0
  counts = np.bincount(draws, minlength=CFG.vocab_size)
  assert counts[~support].sum() == 0
  expected = n * probs[support]
  chi2 = ((counts[support] - expected) ** 2 / expected).sum()
  dof = support.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_no_recompile_within_bucket(params):
  sp = SamplingParams(temperature=0.9, top_p=0.9)
  generate(params, CFG, [[1, 2, 3]], max_new_tokens=6, sampling=sp)
  assert prompt_bucket(3) == prompt_bucket(11)
  with CompileCounter() as counter:
    for prompt, temp in (([4, 5, 6, 7, 8], 0.5), ([9] * 11, 1.3), ([2, 2], 0.7)):
      out = generate(params, CFG, [prompt], max_new_tokens=6,
                     sampling=SamplingParams(temperature=temp, top_p=0.8), key=1)
      jax.block_until_ready(out)
  assert counter.compiles == 0
  # Stop ids are a set: the same ids in another order or repeated reuse the program.
  want = generate(params, CFG, [[1, 2, 3]], max_new_tokens=6, stop_ids=(13, 2))
  with CompileCounter() as counter:
    for stop_ids in ((2, 13), [13, 2, 2], np.asarray([2, 13, 13])):
      assert generate(params, CFG, [[1, 2, 3]], max_new_tokens=6,
                      stop_ids=stop_ids).sequences() == want.sequences()
  assert counter.compiles == 0
  with CompileCounter() as counter:  # the counter does see compilations
    jax.block_until_ready(generate(params, CFG, [[1] * 20], max_new_tokens=6, sampling=sp))
  assert counter.compiles >= 1


def test_loop_is_one_program(params):
  """The whole generate lowers to one HLO module with a while loop and no host callbacks."""
  prompt = jnp.zeros((1, 16), jnp.int32)
  lowered, _ = lower_decode(params, CFG, prompt, jnp.asarray([3]), jax.random.key(0),
                            max_new_tokens=8, cache_size=32)
  text = lowered.as_text()
  assert "stablehlo.while" in text
  assert "callback" not in text


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1, 97]]), "outside the vocabulary"),
    (dict(prompts=[[-1, 2]]), "outside the vocabulary"),
    (dict(prompts=[[1] * 250], max_new_tokens=10), "260 positions, more than the model's "
                                                    "max_position_embeddings=256"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[1]], sampling=SamplingParams(temperature=-1.0)), "temperature"),
    (dict(prompts=[[1]], sampling=SamplingParams(temperature=1.0, top_p=0.0)), "top_p"),
    (dict(prompts=[[1]], sampling=SamplingParams(temperature=1.0, top_p=1.5)), "top_p"),
    (dict(prompts=[[1]], sampling=SamplingParams(top_k=-2)), "top_k"),
    (dict(prompts=[[1]], stop_ids=[200]), "stop ids"),
    (dict(prompts=[[1.5, 2.0]]), "integer token ids"),
    (dict(prompts=["Hello"]), "is text.*Model.encode"),
    (dict(prompts=[[1]], record_top_k=-1), "record_top_k"),
    (dict(prompts=[[1]], record_top_k=10_000), "record_top_k"),
    # whole floats and bools are not sizes (2.0 would reach an array shape inside jit)
    (dict(prompts=[[1]], max_new_tokens=2.0), "max_new_tokens must be a positive integer"),
    (dict(prompts=[[1]], max_new_tokens=True), "max_new_tokens must be a positive integer"),
    (dict(prompts=[[1]], cache_size=30.0), "cache_size must be a positive integer"),
    (dict(prompts=[[1]], cache_size=0), "cache_size must be a positive integer"),
    (dict(prompts=[[1]], sampling=SamplingParams(temperature=1.0, top_k=98)),
     "top_k=98 is more than the vocabulary's 97"),
    (dict(prompts=[[1]], sampling=SamplingParams(temperature=np.array([0.7, 0.0]))),
     r"temperature must be one number for the whole batch or one per row \(1, one per prompt"),
    (dict(prompts=[[1]], key=2**70), "does not fit a signed 64-bit integer"),
    (dict(prompts="Hello"), "prompts is one text"),
    # rows that are no sequences died in len() (a TypeError naming no row)
    (dict(prompts=[[2, 3], 1]), "prompt 1 is int 1, not a sequence of token ids.*Fix"),
    (dict(prompts=[[2, 3], None]), "prompt 1 is NoneType"),
    (dict(prompts=np.array(5)), r"prompts is one id.*Fix: \[\[5\]\]"),
    # a key per row passed the check and failed inside the trace
    (dict(prompts=[[1], [2]], key=jax.random.split(jax.random.key(0), 2)),
     r"key must be one PRNG key, got 2 keys \(shape \(2,\)\).*a call per prompt"),
    (dict(prompts=[[1], [2]], key=jax.random.split(jax.random.PRNGKey(0), 2)),
     r"got 2 keys \(shape \(2, 2\)\)"),
])
def test_bad_input(params, kwargs, match):
  kwargs = {"max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    generate(params, CFG, kwargs.pop("prompts"), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampling=0.8), "sampling must be a jspec SamplingParams.*Fix"),
    (dict(key="seed"), "key must be an integer seed or a JAX PRNG key.*Fix"),
    (dict(key=1.5), "key must be"),
    (dict(key=np.zeros(3)), "key must be.*float64"),
    (dict(stop_ids=2), "stop_ids must be a sequence of token ids.*Fix"),
    (dict(sampling=SamplingParams(temperature="0.7")), "temperature must be a number"),
    (dict(sampling=SamplingParams(top_p=None)), "top_p must be a number"),
])
def test_wrong_types_are_refused_before_jit(params, kwargs, match):
  with pytest.raises(TypeError, match=match):
    generate(params, CFG, [[1, 2]], max_new_tokens=4, **kwargs)


def test_numpy_integer_sizes_count_as_their_values(params):
  """max_new_tokens as a small NumPy integer wrapped in the cache plan's sums: np.uint8(250) after
  a 10-token prompt passed the position check and ended at 55 tokens, np.int8(100) failed in a
  reshape; np.int64 sizes hashed apart from ints and compiled the same program again."""
  prompt = [list(range(1, 11))]
  with pytest.raises(ValueError, match="260 positions"):
    generate(params, CFG, prompt, max_new_tokens=np.uint8(250))
  for small in (np.uint8(200), np.int8(100)):
    out = generate(params, CFG, prompt, max_new_tokens=small, stop_ids=())
    assert out.lengths.tolist() == [int(small)] and out.tokens.shape == (1, int(small))
  generate(params, CFG, [[1, 2, 3]], max_new_tokens=6, cache_size=64)
  with CompileCounter() as counter:
    generate(params, CFG, [[1, 2, 3]], max_new_tokens=np.int64(6), cache_size=np.int64(64))
  assert counter.compiles == 0


@pytest.mark.parametrize("change, match", [
    (dict(prompt=jnp.asarray([1, 2, 3])), r"prompt must be \[B, P\] integer token ids"),
    (dict(prompt=jnp.asarray([[1.0, 2.0]])), r"prompt must be \[B, P\] integer.*float32"),
    (dict(prompt_lengths=jnp.asarray(2)), r"prompt_lengths must be \[B\] = \[1\]"),
    (dict(prompt_lengths=jnp.asarray([2, 2])), r"prompt_lengths must be \[B\] = \[1\]"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(record_top_k=200), r"record_top_k must be an integer in \[0, 97\]"),
])
def test_the_pure_engine_names_what_its_shapes_show(params, change, match):
  """generate_tokens took these to an IndexError, a broadcast or top_k error deep in the trace."""
  args = {**dict(prompt=jnp.asarray([[1, 2, 3, 0]]), prompt_lengths=jnp.asarray([3]),
                 max_new_tokens=4), **change}
  with pytest.raises(ValueError, match=match):
    generate_tokens(params, CFG, args.pop("prompt"), args.pop("prompt_lengths"),
                    jax.random.key(0), cache_size=16, **args)


def test_the_checked_wrappers_inside_a_jit():
  """A traced key is taken (and a seed as a JAX scalar, outside); traced prompts or sampling
  settings name the pure engines to call instead (a bare TracerArrayConversionError before)."""
  params = init_params(CFG, jax.random.key(0), scale=0.3)
  sp = SamplingParams(temperature=1.0)
  run = lambda **kw: generate(params, CFG, kw.pop("prompts", [[1, 2, 3]]), max_new_tokens=3,
                              **kw).tokens
  want = run(sampling=sp, key=5)
  np.testing.assert_array_equal(jax.jit(lambda k: run(sampling=sp, key=k))(jax.random.key(5)),
                                want)
  np.testing.assert_array_equal(run(sampling=sp, key=jnp.int32(5)), want)
  for traced, value in ((lambda p: run(prompts=p), jnp.asarray([[1, 2, 3]])),
                        (lambda t: run(sampling=SamplingParams(temperature=t)), 1.0)):
    with pytest.raises(TypeError, match="traced.*generate_tokens, speculative_generate_tokens"):
      jax.jit(traced)(value)


@pytest.mark.parametrize("other, match", [
    (dict(vocab_size=101), r"embed is \(97, 64\), cfg wants \(101, 64\)"),  # ids clamped before
    (dict(num_layers=3), "the number of layers is 2, cfg wants 3"),  # ran two layers before
    (dict(num_layers=1), "the number of layers is 2, cfg wants 1"),  # ran one of the two before
    (dict(num_heads=8, num_kv_heads=4, head_dim=8), r"layer 0.wq is \(64, 4, 16\)"),
    (dict(qkv_bias=True), "layer 0.bq is absent"),
])
def test_params_of_another_config_are_refused(params, other, match):
  """A Config of another model read the params silently wrong (an id past the embedding was
  clamped to its last row, layers past the Config's count skipped): refused before any trace."""
  with pytest.raises(ValueError,
                     match=f"params do not fit their cfg: {match}.*Fix: pass the Config"):
    generate(params, dataclasses.replace(CFG, **other), [[1, 2]], max_new_tokens=4)


def test_every_weight_layout_fits_its_config(params):
  """The check reads shapes whatever the layout: stacked layers, int8 and 4-bit weights, the CPU
  kernels' output-major ones (each keeps the layer axis somewhere else)."""
  for layout in (stack_layers(params), quantize_params(params, "xla"),
                 stack_layers(quantize_params(params, "native", bits=4)),
                 stack_layers(native_float_params(params))):
    check_params(layout, CFG)
    with pytest.raises(ValueError, match="params do not fit"):
      check_params(layout, dataclasses.replace(CFG, intermediate_size=96))


def test_a_mesh_may_be_text(params):
  want = generate(params, CFG, [[1, 2]], max_new_tokens=4).sequences()
  assert generate(params, CFG, [[1, 2]], max_new_tokens=4, mesh="dp=1").sequences() == want
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh.*Fix"):
    generate(params, CFG, [[1, 2]], max_new_tokens=4, mesh=2)


@pytest.mark.parametrize("key", [3, np.int64(3), jax.random.key(3), jax.random.PRNGKey(3),
                                 np.asarray(jax.random.PRNGKey(3))])
def test_every_form_of_a_seed_gives_the_same_draws(params, key):
  sampled = SamplingParams(temperature=1.0)
  want = generate(params, CFG, [[1, 2]], max_new_tokens=6, sampling=sampled, key=3).sequences()
  assert generate(params, CFG, [[1, 2]], max_new_tokens=6, sampling=sampled,
                  key=key).sequences() == want


def test_one_flat_prompt_is_one_prompt(params):
  """A flat list of ids, a 1-D array and a generator of prompts all mean what they say."""
  want = generate(params, CFG, [[1, 2, 3]], max_new_tokens=4).sequences()
  assert generate(params, CFG, [1, 2, 3], max_new_tokens=4).sequences() == want
  assert generate(params, CFG, np.asarray([1, 2, 3]), max_new_tokens=4).sequences() == want
  assert generate(params, CFG, (p for p in [[1, 2, 3]]), max_new_tokens=4).sequences() == want


def test_explicit_cache_size_limit(params):
  with pytest.raises(ValueError, match="raise cache_size"):
    generate(params, CFG, [[1] * 30], max_new_tokens=10, cache_size=32)
  # A cache larger than the model's positions does not take the text past them (it did, silently).
  with pytest.raises(ValueError, match="260 positions, more than the model's max_position"):
    generate(params, CFG, [[1] * 250], max_new_tokens=10, cache_size=512)
  out = generate(params, CFG, [[1] * 22], max_new_tokens=10, cache_size=32)
  assert int(out.lengths[0]) == 10


def test_a_cache_narrower_than_the_prompt_bucket(params):
  """A cache that holds the text but not the prompt's bucket (an explicit cache_size, or a model
  whose max_position_embeddings is no bucket: 1000, Qwen3's 40,960): the bucket is cut to the
  cache, and the tokens are those of a roomy cache."""
  prompt = [(3 * i) % 90 + 1 for i in range(70)]  # bucket 96
  want = generate(params, CFG, [prompt], max_new_tokens=10).sequences()
  assert generate(params, CFG, [prompt], max_new_tokens=10, cache_size=90).sequences() == want
  odd = dataclasses.replace(CFG, max_position_embeddings=1000)
  long = [(3 * i) % 90 + 1 for i in range(900)]  # bucket 1024
  want = generate(params, dataclasses.replace(CFG, max_position_embeddings=2048), [long],
                  max_new_tokens=10).sequences()
  assert generate(params, odd, [long], max_new_tokens=10).sequences() == want


@pytest.mark.parametrize("engine", ["ar", "chain", "tree"])
def test_pure_engines_end_a_row_where_its_cache_ends(params, engine):
  """A pure engine given a cache too small for max_new_tokens (the wrappers never pass one) ends
  each row where the next step's entries would not fit: its tokens are the full cache's, cut
  short, and as many as the cache holds. The writes past the end used to be dropped and the row
  decoded on from a cache missing them (wrong tokens after 12 of 20 here, silently); a prompt
  wider than the cache is refused at trace time (its entries past the end were dropped too)."""
  from jspec.drafting.ngram import NgramDrafter
  from jspec.speculative.chain import SpecConfig, speculative_generate_tokens
  from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate_tokens
  rows = [PROMPTS[0] + [4], PROMPTS[1]]  # lengths 8 and 2, padded to 16
  full = generate(params, CFG, rows, max_new_tokens=40).sequences()
  tokens, lengths = jnp.asarray([r + [0] * (16 - len(r)) for r in rows]), jnp.asarray([8, 2])
  drafter, key = NgramDrafter(vocab=CFG.vocab_size), jax.random.key(0)
  run, reserve = {  # reserve: slots a step writes past the committed entries
      "ar": (lambda size: generate_tokens(params, CFG, tokens, lengths, key, max_new_tokens=40,
                                          cache_size=size), 1),
      "chain": (lambda size: speculative_generate_tokens(
          params, CFG, drafter, tokens, lengths, key, spec=SpecConfig(gamma=3, max_new_tokens=40),
          cache_size=size), 4),
      "tree": (lambda size: tree_speculative_generate_tokens(
          params, CFG, drafter, tokens, lengths, key,
          spec=TreeSpecConfig("fixed:2-2-1", max_new_tokens=40), cache_size=size), 11),
  }[engine]
  size = 24
  out = run(size)
  for b, (got, want) in enumerate(zip(out.sequences(), full)):
    assert got == want[:len(got)], (b, got, want)
    # A step runs while prompt + generated - 1 + reserve <= size (a round emits >= 1 token).
    most = size - len(rows[b]) + 1
    assert most - reserve + 1 <= len(got) <= most if engine != "ar" else len(got) == most, b
  with pytest.raises(ValueError, match="padded to 16 tokens do not fit cache_size=12"):
    run(12)


def test_prompt_buckets():
  buckets = [prompt_bucket(n) for n in range(1, 2049)]
  assert all(b >= n for n, b in zip(range(1, 2049), buckets))
  assert buckets == sorted(buckets)
  assert len(set(buckets)) == 15  # 16, 24, 32, ..., 1536, 2048: few programs
  assert all((b - n) / b < 1 / 3 + 1e-9 for n, b in zip(range(17, 2049), buckets[16:]))
