"""Repetition, presence and frequency penalties (jspec.sampling.penalties): the penalized logits
against a reference written from the definitions (and transformers' repetition processor),
autoregressive decoding against a step-by-step host loop and transformers' generate, greedy
speculative output (chains, trees, n-gram lookup, under a KV budget) identical to autoregressive
output, sampled speculative output distributed as the penalized target's (chi-square against
enumeration), each with a control that must fail; log-probabilities, compiles, bad input."""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.bench.profiling import CompileCounter
from jspec.drafting.model import ModelDrafter, self_drafter
from jspec.drafting.ngram import ngram_drafter
from jspec.generate import generate
from jspec.kv.policy import KVPolicy
from jspec.models.llama import init_params
from jspec.sampling import penalties
from jspec.sampling.penalties import History, chain_paths, penalize, tree_paths
from jspec.sampling.processing import Mode, SamplingParams, processed_logprobs
from jspec.speculative import chain as chain_engine
from jspec.speculative import tree as tree_engine
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_generate_tokens
from jspec.speculative.tree import (TreeSpecConfig, tree_speculative_generate,
                                    tree_speculative_generate_tokens)
from jspec.tree.structure import Siblings, Tree
from test_speculative import (N_SAMPLES, PROMPTS, TARGET, TINY, TINY_PROMPT, chi_square,
                              noised_drafter)
from tiny_models import causal_logits, teacher_forced_rows

PENALTIES = {
    "repetition": SamplingParams(repetition_penalty=1.6),
    "repetition-below-1": SamplingParams(repetition_penalty=0.6),
    "presence-frequency": SamplingParams(presence_penalty=0.8, frequency_penalty=0.7),
    "all": SamplingParams(repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=0.9),
}


def reference(x: np.ndarray, prompt, generated, sp: SamplingParams) -> np.ndarray:
  """One position's penalized logits [V], from the definitions: a token of the prompt or the
  output has its logit divided by r if positive, else multiplied by r; a token generated c times
  loses presence * [c > 0] + frequency * c."""
  x = np.array(x, np.float64)
  r, a, f = (float(sp.repetition_penalty), float(sp.presence_penalty),
             float(sp.frequency_penalty))
  for v in set(prompt) | set(generated):
    x[v] = x[v] / r if x[v] > 0 else x[v] * r
  counts = np.bincount(np.asarray(list(generated), int), minlength=x.size)
  return x - a * (counts > 0) - f * counts


# ---------------------------------------------------------------------------- the logits
@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_penalize_matches_the_definition(name):
  """Each position of a [B, T, V] block (chain paths with repeated drafts) against `reference`
  over its own text: prompt, generated tokens, then the drafts before the position."""
  sp = PENALTIES[name]
  rng = np.random.default_rng(0)
  B, G, V = 3, 5, 12
  prompts = [[1, 2, 2, 7], [0], [11, 3, 5, 5, 5, 9]]
  generated = [[2, 4, 4], [], [9, 10]]
  drafts = np.array([[4, 4, 8, 2, 4], [0, 1, 0, 1, 0], [6, 6, 6, 6, 6]])
  x = rng.normal(0, 2, (B, G + 1, V)).astype(np.float32)
  P = max(map(len, prompts))
  history = History.of_prompt(jnp.asarray([p + [5] * (P - len(p)) for p in prompts]),
                              jnp.asarray([len(p) for p in prompts]), V)
  G_ = max(map(len, generated))
  history = history.add(jnp.asarray([g + [0] * (G_ - len(g)) for g in generated]),
                        jnp.asarray([[j < len(g) for j in range(G_)] for g in generated]))
  got = np.asarray(penalize(jnp.asarray(x), history, sp, chain_paths(jnp.asarray(drafts))))
  for b, i in itertools.product(range(B), range(G + 1)):
    want = reference(x[b, i], prompts[b], generated[b] + list(drafts[b, :i]), sp)
    np.testing.assert_allclose(got[b, i], want, rtol=1e-6, atol=1e-6, err_msg=f"{b} {i}")
  # Without paths every position follows the history alone.
  flat = np.asarray(penalize(jnp.asarray(x), history, sp))
  for b in range(B):
    np.testing.assert_allclose(flat[b, 3], reference(x[b, 3], prompts[b], generated[b], sp),
                               rtol=1e-6, atol=1e-6)


def test_repetition_penalty_matches_transformers():
  """The repetition part against transformers' own processor (prompt + output ids)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  rng = np.random.default_rng(1)
  V = 50
  ids = rng.integers(0, V, (2, 9))
  x = rng.normal(0, 3, (2, V)).astype(np.float32)
  for r in (1.3, 0.7):
    want = transformers.RepetitionPenaltyLogitsProcessor(r)(torch.as_tensor(ids),
                                                            torch.as_tensor(x)).numpy()
    history = History.of_prompt(jnp.asarray(ids[:, :5]), jnp.asarray([5, 5]), V).add(
        jnp.asarray(ids[:, 5:]), jnp.ones((2, 4), bool))
    got = penalize(jnp.asarray(x), history, SamplingParams(repetition_penalty=r))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_tree_paths_follow_each_nodes_ancestors():
  """Node n's penalties count the tokens of its path (itself included), no sibling's."""
  #          0:a   1:b     (children of the root)
  #          2:a(0) 3:c(0)  4:a(1)
  #          5:a(2)
  tokens = jnp.asarray([[3, 4, 3, 5, 3, 3, 0]])
  parents = jnp.asarray([[-1, -1, 0, 0, 1, 2, -1]])
  valid = jnp.asarray([[True] * 6 + [False]])
  depth = jnp.asarray([[1, 1, 2, 2, 2, 3, 0]])
  tree = Tree(tokens=tokens, parents=parents, depth=depth, valid=valid,
              q=jnp.zeros((1, 8, 6)), max_depth=3, siblings=Siblings.FIXED)
  paths = np.asarray(tree_paths(tree))
  assert paths.shape == (1, 8, 3)
  want = [[], [3], [4], [3, 3], [3, 5], [4, 3], [3, 3, 3], []]
  assert [sorted(p[p >= 0].tolist()) for p in paths[0]] == [sorted(w) for w in want]
  history = History.of_prompt(jnp.asarray([[1]]), jnp.asarray([1]), 6)
  x = jnp.ones((1, 8, 6))
  got = np.asarray(penalize(x, history, SamplingParams(frequency_penalty=1.0),
                            jnp.asarray(paths)))
  np.testing.assert_allclose(got[0, :, 3], [1, 0, 1, -1, 0, 0, -2, 1])


def test_penalties_off_leave_the_logits_alone():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 8)), jnp.bfloat16)
  history = History.of_prompt(jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([2, 2]), 8)
  assert penalize(x, history, SamplingParams(temperature=0.5)) is x  # static mode: untouched
  traced = jax.jit(lambda sp: penalize(x, history, sp))(SamplingParams(mode=None))
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(x, np.float32))
  assert penalize(x, None, SamplingParams(mode=None)) is x  # no history: nothing to count
  with pytest.raises(ValueError, match="no History of the text"):
    penalize(x, None, PENALTIES["all"])


# ---------------------------------------------------------------------------- autoregressive
@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


def host_logits(params, cfg, text: list[int]) -> np.ndarray:
  """causal_logits on the host in float64, padded to 48 (every text here: one program)."""
  return np.asarray(causal_logits(params, cfg, text, width=48), np.float64)


def host_greedy(params, cfg, prompt, steps, sp):
  """Greedy decoding with the penalties, one full forward per token on the host's text."""
  text = list(prompt)
  for _ in range(steps):
    x = reference(host_logits(params, cfg, text)[-1], prompt, text[len(prompt):], sp)
    text.append(int(np.argmax(x)))
  return text[len(prompt):]


@pytest.mark.parametrize("name", ["repetition", "presence-frequency"])
def test_autoregressive_matches_a_host_loop(target, name):
  sp = PENALTIES[name]
  out = generate(target, TARGET, PROMPTS[:2], max_new_tokens=12, sampling=sp).sequences()
  for prompt, got in zip(PROMPTS[:2], out):
    assert got == host_greedy(target, TARGET, prompt, 12, sp)
  assert out != generate(target, TARGET, PROMPTS[:2], max_new_tokens=12).sequences()


def test_autoregressive_matches_transformers_generate(tmp_path):
  """Greedy with repetition_penalty, the same ids as transformers' generate on one checkpoint."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import ggufutil
  from jspec.io.checkpoint import load_hf
  d, config, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama")
  ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
  cfg, params = load_hf(d)
  prompt = [3, 14, 15, 92, 65, 35, 89, 79]
  with torch.no_grad():
    want = ref.generate(torch.as_tensor([prompt]), max_new_tokens=16, do_sample=False,
                        repetition_penalty=1.4, pad_token_id=0)[0, len(prompt):].tolist()
  got = generate(params, cfg, [prompt], max_new_tokens=16,
                 sampling=SamplingParams(repetition_penalty=1.4)).sequences()[0]
  plain = generate(params, cfg, [prompt], max_new_tokens=16).sequences()[0]
  assert got == want and got != plain


# ---------------------------------------------------------------------------- greedy identity
@pytest.fixture(scope="module")
def drafter(target):
  return noised_drafter(target, 0.1)


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_speculative_identical_to_autoregressive(target, drafter, name):
  sp = PENALTIES[name]
  want = generate(target, TARGET, PROMPTS, max_new_tokens=24, sampling=sp).sequences()
  chain = speculative_generate(target, TARGET, drafter, PROMPTS, sampling=sp,
                               spec=SpecConfig(gamma=4, max_new_tokens=24))
  tree = tree_speculative_generate(target, TARGET, drafter, PROMPTS, sampling=sp,
                                   spec=TreeSpecConfig("fixed:3-2-1", max_new_tokens=24))
  assert chain.sequences() == want and tree.sequences() == want
  assert chain.block_efficiency > 1.2 and tree.block_efficiency > 1.2


def test_ngram_drafts_of_repeats_and_a_kv_budget(target):
  """A lookup drafter proposes what the text repeated, which the penalties push against; under a
  KV budget the history still counts every token (evictions drop cache entries, not text)."""
  sp = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)
  prompts = [p * 3 for p in PROMPTS]
  lookup = ngram_drafter(TARGET.vocab_size)
  want = generate(target, TARGET, prompts, max_new_tokens=20, sampling=sp).sequences()
  assert speculative_generate(target, TARGET, lookup, prompts, sampling=sp,
                              spec=SpecConfig(gamma=3, max_new_tokens=20)).sequences() == want
  kv = KVPolicy("keydiff", budget=16, sinks=2, window=4, chunk=8, evict_every=4)
  want = generate(target, TARGET, prompts, max_new_tokens=20, sampling=sp, kv=kv).sequences()
  unpenalized = generate(target, TARGET, prompts, max_new_tokens=20, kv=kv).sequences()
  assert want != unpenalized
  for out in (speculative_generate(target, TARGET, lookup, prompts, sampling=sp, kv=kv,
                                   spec=SpecConfig(gamma=3, max_new_tokens=20)),
              tree_speculative_generate(target, TARGET, self_drafter(target, TARGET), prompts,
                                        sampling=sp, kv=kv,
                                        spec=TreeSpecConfig("fixed:2-1", max_new_tokens=20))):
    assert out.sequences() == want


def test_drafts_before_a_position_must_count(target, monkeypatch):
  """Control: penalizing every block position for the committed text alone (the drafts before
  it ignored) breaks greedy identity: the self-drafter proposes the unpenalized chain, which a
  wrongly penalized target accepts too often."""
  sp = PENALTIES["repetition"]
  want = generate(target, TARGET, PROMPTS, max_new_tokens=24, sampling=sp).sequences()
  monkeypatch.setattr(chain_engine, "chain_paths", lambda d: jnp.full(
      (d.shape[0], d.shape[1] + 1, d.shape[1]), -1, jnp.int32))
  out = speculative_generate(target, TARGET, self_drafter(target, TARGET), PROMPTS, sampling=sp,
                             spec=SpecConfig(gamma=4, max_new_tokens=24, stop_ids=(63,)))
  assert out.sequences() != want


# ---------------------------------------------------------------------------- sampled: lossless
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.8, presence_penalty=0.6,
                         frequency_penalty=0.8)


def exact_distribution(params, sp: SamplingParams, prompt=TINY_PROMPT) -> np.ndarray:
  """The penalized target's law over its first three tokens, by enumeration: the model's logits
  after every prefix (one forward over prompt + each pair), penalized by `reference` for that
  prefix, then processed (temperature, top-p) by jspec's tested processed_logprobs."""
  V = TINY.vocab_size
  rows = jnp.asarray([prompt + list(p) for p in itertools.product(range(V), repeat=2)])
  logits = np.asarray(teacher_forced_rows(params, TINY, rows)[0], np.float64)
  P = len(prompt)
  pairs = list(itertools.product(range(V), repeat=2))
  penalized = np.stack([[reference(logits[a * V + b, P - 1 + t], prompt, (a, b)[:t], sp)
                         for t in range(3)] for a, b in pairs])  # [V * V, 3, V]
  laws = np.exp(np.asarray(processed_logprobs(jnp.asarray(penalized, jnp.float32), sp),
                           np.float64))
  joint = np.zeros((V,) * 3)
  for (a, b), law in zip(pairs, laws):
    joint[a, b] = law[0][a] * law[1][b] * law[2]
  joint = joint.reshape(-1)
  return joint / joint.sum()


@pytest.fixture(scope="module")
def close_pair():
  target = init_params(TINY, jax.random.key(10), scale=0.8)
  noise = init_params(TINY, jax.random.key(12), scale=0.8)
  return target, ModelDrafter(jax.tree.map(lambda a, b: a + 0.2 * b if a.ndim > 1 else a, target,
                                           noise), TINY)


_EXACT = {}


def exact(params) -> np.ndarray:
  """exact_distribution(params, SAMPLED), computed once per module's target."""
  if id(params) not in _EXACT:
    _EXACT[id(params)] = exact_distribution(params, SAMPLED)
  return _EXACT[id(params)]


def sampled_codes(params, drafter, engine: str, seed: int = 0) -> np.ndarray:
  lengths = jnp.asarray([len(TINY_PROMPT)])
  prompt = jnp.asarray([TINY_PROMPT + [0] * (16 - len(TINY_PROMPT))])
  if engine == "chain":
    one = lambda k: speculative_generate_tokens(
        params, TINY, drafter, prompt, lengths, k, SAMPLED,
        spec=SpecConfig(gamma=2, max_new_tokens=3), cache_size=32).tokens[0]
  else:
    one = lambda k: tree_speculative_generate_tokens(
        params, TINY, drafter, prompt, lengths, k, SAMPLED,
        spec=TreeSpecConfig(engine, max_new_tokens=3), cache_size=32).tokens[0]
  tokens = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(seed), N_SAMPLES)))
  assert (tokens >= 0).all()
  return tokens[:, 0] * 256 + tokens[:, 1] * 16 + tokens[:, 2]


@pytest.mark.parametrize("engine", ["chain", "chain-draft-penalties", "rsd-c:2-2-draft-penalties"])
def test_sampling_with_penalties_is_lossless(close_pair, engine):
  """Chains and trees; "-draft-penalties": the drafter proposing under the penalties too (its q
  the law it drew from, penalized for its own earlier drafts: a tree node's children for the
  node's path). The verification of a tree drafted unpenalized is the same code as this one's."""
  target, drafter = close_pair
  if engine.endswith("-draft-penalties"):
    engine, drafter = engine.removesuffix("-draft-penalties"), drafter.with_draft_penalties()
  probs = exact(target)
  stat, dof, ok = chi_square(sampled_codes(target, drafter, engine), probs)
  assert ok, (engine, stat, dof)
  # The penalties matter here: the unpenalized law is far from the sampled one.
  plain = exact_distribution(target, SamplingParams(temperature=1.0, top_p=0.95))
  assert 0.5 * np.abs(plain - probs).sum() > 0.2


def test_sampling_that_ignores_the_drafts_is_caught(close_pair, monkeypatch):
  """Control: the tree verifier penalizing every node for the committed text alone fails the
  same test."""
  target, drafter = close_pair
  monkeypatch.setattr(tree_engine, "tree_paths", lambda tree: jnp.full(
      (tree.tokens.shape[0], tree.num_nodes + 1, tree.max_depth), -1, jnp.int32))
  stat, dof, ok = chi_square(sampled_codes(target, drafter, "rsd-c:2-2"), exact(target))
  assert not ok, (stat, dof)


# ---------------------------------------------------------------------------- the rest
def test_logprobs_under_penalties(target, drafter):
  """"sampled" logprobs are the penalized law's, "model" the model's own; greedy speculative
  and autoregressive runs report the same."""
  sp = dataclasses.replace(PENALTIES["all"], temperature=0.8)
  prompts = PROMPTS[:2]
  out = generate(target, TARGET, prompts, max_new_tokens=8, sampling=sp, key=3,
                 logprobs="sampled")
  model = generate(target, TARGET, prompts, max_new_tokens=8, sampling=sp, key=3,
                   logprobs="model")
  assert out.sequences() == model.sequences()
  for b, (prompt, toks) in enumerate(zip(prompts, out.sequences())):
    x = host_logits(target, TARGET, prompt + toks)
    for j, tok in enumerate(toks):
      pen = reference(x[len(prompt) - 1 + j], prompt, toks[:j], sp)
      want = np.asarray(processed_logprobs(jnp.asarray(pen, jnp.float32), sp))[tok]
      raw = x[len(prompt) - 1 + j] - np.log(np.exp(x[len(prompt) - 1 + j]).sum())
      np.testing.assert_allclose(float(out.logprobs[b, j]), want, atol=2e-5)
      np.testing.assert_allclose(float(model.logprobs[b, j]), raw[tok], atol=2e-5)
  greedy = PENALTIES["all"]
  ar = generate(target, TARGET, PROMPTS, max_new_tokens=16, sampling=greedy, logprobs="model")
  spec = speculative_generate(target, TARGET, drafter, PROMPTS, sampling=greedy,
                              spec=SpecConfig(gamma=3, max_new_tokens=16, logprobs="model"))
  np.testing.assert_allclose(np.asarray(spec.logprobs), np.asarray(ar.logprobs), atol=1e-5)


def test_new_penalty_values_reuse_the_program(target, drafter):
  spec = SpecConfig(gamma=3, max_new_tokens=8)
  speculative_generate(target, TARGET, drafter, [[1, 2, 3]], spec=spec,
                       sampling=SamplingParams(repetition_penalty=1.1))
  generate(target, TARGET, [[1, 2, 3]], max_new_tokens=8,
           sampling=SamplingParams(repetition_penalty=1.1))
  with CompileCounter() as counter:
    for r, f in ((1.5, 0.0), (0.9, 0.4)):
      sp = SamplingParams(repetition_penalty=r, frequency_penalty=f)
      jax.block_until_ready(speculative_generate(target, TARGET, drafter, [[4, 5]], spec=spec,
                                                 sampling=sp).tokens)
      jax.block_until_ready(generate(target, TARGET, [[4, 5]], max_new_tokens=8,
                                     sampling=sp).tokens)
  assert counter.compiles == 0


def test_mode_and_bad_values():
  assert SamplingParams(frequency_penalty=0.1).mode == Mode(greedy=True, filtered=False,
                                                            min_p=False, penalized=True)
  assert not SamplingParams(repetition_penalty=1.0).mode.penalized
  assert SamplingParams(mode=None).needs_history and not SamplingParams().needs_history
  for bad, match in ((dict(repetition_penalty=0.0), "repetition_penalty must be a finite number"),
                     (dict(repetition_penalty=float("inf")), "repetition_penalty"),
                     (dict(presence_penalty=float("nan")), "presence_penalty must be a finite"),
                     (dict(frequency_penalty=float("-inf")), "frequency_penalty must be a finite")):
    with pytest.raises(ValueError, match=match):
      SamplingParams(**bad).validate()
  with pytest.raises(ValueError, match="repetition_penalty"):
    generate(init_params(TINY, jax.random.key(0)), TINY, [[1]], max_new_tokens=2,
             sampling=SamplingParams(repetition_penalty=-1.0))
  assert penalties.History.of_prompt(jnp.asarray([[1, 99]]), jnp.asarray([1]), 4).in_prompt[
      0].tolist() == [False, True, False, False]  # padding past the length is not the prompt


def test_cli_flags(tmp_path, capsys):
  """--repetition-penalty / --presence-penalty / --frequency-penalty: the same text with a
  drafter as without, another text than unpenalized; a bad value exits with the message."""
  import ggufutil
  from jspec.cli import main
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama", max_position_embeddings=512)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  base = ["generate", "--model", str(d), "--prompt", "Why is the sky blue?", "--max-new-tokens",
          "16"]
  flags = ["--repetition-penalty", "1.5", "--presence-penalty", "0.3", "--frequency-penalty", "0.4"]
  texts, efficiency = [], []
  drafted = flags + ["--drafter", "self", "--gamma", "3"]
  for extra in (flags, drafted, [], drafted + ["--no-draft-penalties"]):
    assert main(base + extra) == 0
    out, err = capsys.readouterr()
    texts.append(out)
    efficiency.append(re.findall(r"block efficiency ([0-9.]+)", err))
  assert texts[0] == texts[1] == texts[3] != texts[2]
  # `self` drafts the penalized target's own tokens (all accepted); --no-draft-penalties turns
  # that off, and the drafts the penalties change are rejected.
  (on,), (off,) = efficiency[1], efficiency[3]
  assert float(off) < float(on), (on, off)
  assert main(base + ["--repetition-penalty", "0"]) == 2
  assert "--repetition-penalty must be a finite number > 0" in capsys.readouterr().err
  # bench / bench-tau default output names carry the penalties a run used.
  import argparse
  from jspec.cli.options import penalty_tag
  assert penalty_tag(argparse.Namespace(repetition_penalty=1.2, presence_penalty=0.0,
                                        frequency_penalty=0.5)) == "_rep1.2_freq0.5"
  assert penalty_tag(argparse.Namespace(repetition_penalty=1.0, presence_penalty=0.0,
                                        frequency_penalty=0.0)) == ""
  assert penalty_tag(argparse.Namespace(repetition_penalty=1.3, presence_penalty=0.0,
                                        frequency_penalty=0.0,
                                        draft_penalties=False)) == "_rep1.3_nodraftpen"


# ---------------------------------------------------------------------------- drafters
@pytest.mark.parametrize("engine, trimmed", [("chain", False), ("chain", True), ("tree", True)])
def test_a_drafter_proposes_under_the_penalties(target, engine, trimmed):
  """The target as its own drafter, penalizing each draft for the text and the drafts before it
  (a tree's: each frontier node's path), proposes exactly the penalized target's greedy tokens:
  every draft of a chain, every top path of a tree accepted. A VocabTrim head (here keeping every
  id, permuted) is penalized in the full vocabulary and mapped back."""
  from jspec.drafting.model import trimmed_drafter
  from jspec.models.vocab_trim import trim_head
  sp = PENALTIES["all"]
  drafter = self_drafter(target, TARGET)
  if trimmed:
    keep = np.random.default_rng(3).permutation(TARGET.vocab_size)
    drafter = trimmed_drafter(trim_head(target, keep), TARGET, keep).with_draft_penalties()
  if engine == "chain":  # 1 + 4 rounds of 5 tokens
    run = lambda d: speculative_generate(target, TARGET, d, PROMPTS, sampling=sp,
                                         spec=SpecConfig(gamma=4, max_new_tokens=21))
  else:  # 1 + 5 rounds of 4 tokens
    run = lambda d: tree_speculative_generate(target, TARGET, d, PROMPTS, sampling=sp,
                                              spec=TreeSpecConfig("fixed:2-2-1",
                                                                  max_new_tokens=21))
  full = 5.0 if engine == "chain" else 4.0
  want = generate(target, TARGET, PROMPTS, max_new_tokens=21, sampling=sp).sequences()
  out = run(drafter)
  assert out.sequences() == want and out.block_efficiency == full
  # Off (a draft model's default): the same drafter proposes the unpenalized drafts.
  out = run(drafter.with_draft_penalties(False))
  assert out.sequences() == want and out.block_efficiency < full - 0.5


def two_layers():
  """(params, cfg) of a random two-layer TINY: a model a layer-skip draft can run part of."""
  cfg = dataclasses.replace(TINY, num_layers=2)
  return init_params(cfg, jax.random.key(0)), cfg


def test_draft_penalties_setting():
  """On for the target as its own drafter and layer skipping, off for draft models and probing;
  the n-gram lookup passes it to its fallback (and reads it back from there); a drafter that does
  not draw from logits refuses it."""
  from jspec.drafting.probe import probe_drafter
  from jspec.drafting.skip import skip_drafter
  params = init_params(TINY, jax.random.key(0))
  assert self_drafter(params, TINY).draft_penalties
  assert skip_drafter(*two_layers(), [0]).draft_penalties
  assert not probe_drafter(params, TINY, 2).draft_penalties
  model = ModelDrafter(params, TINY)
  assert not model.draft_penalties
  hybrid = ngram_drafter(TINY.vocab_size, fallback=model)
  assert not hybrid.draft_penalties and not ngram_drafter(TINY.vocab_size).draft_penalties
  assert hybrid.with_draft_penalties().fallback.draft_penalties
  assert hybrid.with_draft_penalties().draft_penalties  # what a tree's frontiers read
  with pytest.raises(ValueError, match="does not draw its drafts from logits"):
    ngram_drafter(TINY.vocab_size).with_draft_penalties()


def test_a_drafter_that_ignores_its_own_drafts_is_rejected_more(target, monkeypatch):
  """Control: a draft penalized for the committed text alone (not the drafts before it) is
  rejected where those drafts repeat a token: the same run accepts less."""
  from jspec.drafting import base
  sp = PENALTIES["all"]
  blind = penalties.chain_draft_penalty
  monkeypatch.setattr(base, "chain_draft_penalty", lambda history, sp: (
      None if history is None else
      lambda logits, tokens, i: blind(history, sp)(logits, tokens, 0)))
  out = speculative_generate(target, TARGET, self_drafter(target, TARGET), PROMPTS, sampling=sp,
                             spec=SpecConfig(gamma=4, max_new_tokens=21, stop_ids=(63,)))
  assert out.sequences() == generate(target, TARGET, PROMPTS, max_new_tokens=21, sampling=sp,
                                     stop_ids=(63,)).sequences()
  assert out.block_efficiency < 5.0


def test_settings_decided_inside_the_program_and_streams(target, drafter):
  """mode=None (one program for every setting, the history always carried): the same tokens as
  the static mode, penalties on or off; streamed runs give the whole run's tokens."""
  from jspec.generate import generate_stream
  from jspec.speculative.chain import speculative_generate_stream
  spec = SpecConfig(gamma=3, max_new_tokens=16)
  for sp in (PENALTIES["all"], SamplingParams()):
    want = generate(target, TARGET, PROMPTS, max_new_tokens=16, sampling=sp).sequences()
    traced = dataclasses.replace(sp, mode=None)
    assert generate(target, TARGET, PROMPTS, max_new_tokens=16, sampling=traced).sequences() \
        == want
    assert speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec,
                                sampling=traced).sequences() == want
  sp = PENALTIES["all"]
  want = generate(target, TARGET, PROMPTS, max_new_tokens=16, sampling=sp).sequences()
  for stream in (generate_stream(target, TARGET, PROMPTS, max_new_tokens=16, sampling=sp, every=3),
                 speculative_generate_stream(target, TARGET, drafter, PROMPTS, spec=spec,
                                             sampling=sp, every=2)):
    for _ in stream:
      pass
    assert stream.output.sequences() == want


def test_a_drafter_written_before_penalties_still_runs(target, drafter):
  """A drafter whose propose does not take penalty_history (a user's, written to the older
  protocol) is not handed one: it proposes unpenalized, the output is the same."""
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass
  class OldSignature(ModelDrafter):
    own: bool = dataclasses.field(default=True, metadata=dict(static=True))

    def propose(self, state, last2, seq_len, key, sampling, gamma, pick=None):
      return super().propose(state, last2, seq_len, key, sampling, gamma, pick)

  old = OldSignature(drafter.params, TARGET)
  sp = PENALTIES["repetition"]
  want = generate(target, TARGET, PROMPTS, max_new_tokens=16, sampling=sp).sequences()
  for run in (old, ngram_drafter(TARGET.vocab_size, fallback=old)):  # alone, as a fallback
    assert speculative_generate(target, TARGET, run, PROMPTS, sampling=sp,
                                spec=SpecConfig(gamma=3, max_new_tokens=16)).sequences() == want


def test_bench_tau_refuses_presence_and_frequency_penalties(target, drafter):
  from jspec.bench.paired_tau import paired_tau
  from jspec.tree.shapes import parse_tree
  with pytest.raises(ValueError, match="presence and frequency penalties count generated"):
    paired_tau(target, TARGET, drafter, [[1, 2, 3]], [parse_tree("fixed:2-1")],
               sampling=SamplingParams(frequency_penalty=0.5), progress=False)
