"""Mask-token probing (jspec.drafting.probe, ESP): the masks never touch the verified block or the
committed cache (a layout that lets them leak is caught), the probe's logits are the target's at
masks placed after the last accepted token, output stays the target's (greedy identity, sampled
distribution with a control that must fail), and bad settings are refused before tracing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.decode import prepare_batch
from jspec.drafting.ngram import ngram_drafter
from jspec.drafting.probe import EMA_RATE, ProbeDrafter, probe_drafter
from jspec.generate import generate
from jspec.kv.policy import KVPolicy
from jspec.models.cache import KVCache
from jspec.models.llama import init_params, lm_head
from jspec.sampling.processing import GREEDY, SamplingParams
from jspec.speculative.chain import SpecConfig, speculative_generate, speculative_loop
from jspec.speculative.probing import causal, probe_layout
from jspec.speculative.tree import TreeSpecConfig, tree_speculative_generate, tree_speculative_loop
from test_ngram import REPEATING
from test_speculative import (N_SAMPLES, PROMPTS, TARGET, TINY, chi_square, exact_distribution,
                              own_program, sample_sequences)
from test_tree_engine import sample_codes
from tiny_models import jitted_forward

PROMPT_SET = PROMPTS[:2] + REPEATING[:2]


@pytest.fixture(scope="module")
def target():
  return init_params(TARGET, jax.random.key(0), scale=0.3)


def _prefilled(params):
  """A 32-slot cache holding a 5-token prefix."""
  cache = KVCache.init(TARGET, 1, 32)
  _, _, cache = jitted_forward(params, TARGET, jnp.asarray([[3, 9, 4, 1, 7]]), jnp.arange(5)[None],
                               cache)
  return cache.commit(5)


def test_masks_leave_the_block_exact_and_a_leak_is_caught(target):
  """A 4-token block with 2 masks after each token, laid out as the engines do: the block's
  logits and the KV entries a round may commit are those of the block alone. The control puts
  the masks' entries first (where the block's should be): block tokens then see them."""
  block, T, k = jnp.asarray([[5, 2, 8, 6]]), 4, 2
  positions = 5 + jnp.arange(T)[None]
  plain, _, plain_cache = jitted_forward(target, TARGET, block, positions, _prefilled(target))
  mask, pos = probe_layout(causal(1, T), positions, k)
  masks = jnp.full((1, T * k, TARGET.hidden_size), 0.05)
  probed, _, cache = jitted_forward(target, TARGET, block, pos, _prefilled(target), mask,
                                    appended=masks, logits_indices=jnp.arange(T)[None])
  np.testing.assert_allclose(np.asarray(probed), np.asarray(plain), atol=1e-4)
  np.testing.assert_allclose(np.asarray(cache.k[:, :, :5 + T]),
                             np.asarray(plain_cache.k[:, :, :5 + T]), atol=1e-4)
  order = jnp.concatenate([jnp.arange(T, T * (1 + k)), jnp.arange(T)])  # masks, then the block
  leaked, _, _ = jitted_forward(target, TARGET, jnp.zeros((1, 0), jnp.int32), pos[:, order],
                                _prefilled(target), appended=jnp.concatenate(
                                    [masks, target.embed[block]], axis=1))
  assert np.abs(np.asarray(leaked[:, T * k:]) - np.asarray(plain)).max() > 1e-3


def _mask_embedding(params, prompt, committed):
  """ESP's mask: the prompt's mean input embedding, moved toward each committed token's."""
  m = np.asarray(params.embed)[prompt].mean(0)
  for t in committed:
    m = m + EMA_RATE * (np.asarray(params.embed)[t] - m)
  return m


def _masks_after(params, context, m, k, positions=None, cfg=TARGET):
  """The target's logits [1, k, V] at k masks (embedding m) after `context`, from scratch: the
  context at RoPE `positions` (default 0 .. L - 1), the masks at the next k after its last."""
  L = len(context)
  positions = list(range(L)) if positions is None else list(positions)
  positions += [positions[-1] + j for j in range(1, k + 1)]
  masks = jnp.broadcast_to(jnp.asarray(m, jnp.float32), (1, k, cfg.hidden_size))
  _, hidden, _ = jitted_forward(params, cfg, jnp.asarray([context]), jnp.asarray([positions]),
                                KVCache.init(cfg, 1, L + k), appended=masks)
  return lm_head(params, hidden[:, L:])


@pytest.mark.parametrize("block_mask,positions,ends", [
    (np.tril(np.ones((4, 4), bool)), [0, 1, 2, 3], {0: [0], 2: [0, 1, 2], 3: [0, 1, 2, 3]}),
    # A tree: root 0; nodes 1, 2 children of the root; node 3 a child of node 1.
    (np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool), [0, 1, 1, 2],
     {2: [0, 2], 3: [0, 1, 3]}),
])
def test_masks_after_any_block_token_see_exactly_its_path(target, block_mask, positions, ends):
  """probe_layout + probe_hidden: the masks that follow block token `end` hold what k masks
  after the prefix and end's root-to-end path give from scratch."""
  from jspec.speculative.probing import probe_hidden
  prefix, block, k = [3, 9, 4, 1, 7], [5, 2, 8, 6], 2
  cache = KVCache.init(TARGET, 1, 32)
  _, _, cache = jitted_forward(target, TARGET, jnp.asarray([prefix]), jnp.arange(5)[None], cache)
  m = np.linspace(-0.1, 0.1, TARGET.hidden_size)
  mask, pos = probe_layout(jnp.asarray(block_mask)[None], 5 + jnp.asarray([positions]), k)
  masks = jnp.broadcast_to(jnp.asarray(m, jnp.float32), (1, 4 * k, TARGET.hidden_size))
  _, hidden, _ = jitted_forward(target, TARGET, jnp.asarray([block]), pos, cache.commit(5), mask,
                                appended=masks)
  for end, path in ends.items():
    got = lm_head(target, probe_hidden(hidden, 4, k, jnp.asarray([end])))
    want = _masks_after(target, prefix + [block[i] for i in path], m, k)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, err_msg=str(end))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Primed(ProbeDrafter):
  """A probe whose first round drafts given tokens [B, k] (then probes as usual)."""

  primed: jax.Array | None = None

  def init(self, prompt, prompt_lengths, cache_size, features):
    state = super().init(prompt, prompt_lengths, cache_size, features)
    return dataclasses.replace(state, logits=10.0 * jax.nn.one_hot(self.primed, self.vocab_size))


@pytest.mark.parametrize("engine", ["chain", "tree"])
def test_probe_after_a_round_reads_the_masks_after_its_last_accepted_token(target, engine):
  """A first round primed with the target's own next two tokens accepts both; the drafter's
  probe is then the target's logits at 2 masks after prompt + [first, d1, d2] (mask embedding:
  the prompt's mean moved by `first`), and its mask moves on by d1, d2 and the bonus token."""
  prompt, k = PROMPTS[1], 2
  ar = generate(target, TARGET, [prompt], max_new_tokens=4).sequences()[0]
  head = probe_drafter(target, TARGET, k)
  drafter = _Primed(head=head.head, cfg=TARGET, probe_masks=k, primed=jnp.asarray([ar[1:3]]))
  if engine == "chain":
    spec, reserve, loop = SpecConfig(gamma=2, max_new_tokens=4), 3 * (1 + k), speculative_loop
  else:
    spec, reserve = TreeSpecConfig("dynamic:4,2,1,2", max_new_tokens=4), 5 * (1 + k)
    loop = tree_speculative_loop
  b = prepare_batch(TARGET, [prompt], max_new_tokens=4, sampling=GREEDY, key=0, stop_ids=(),
                    cache_size=None, reserve=reserve, reserve_for="the block")
  run = lambda d, t, n, key: loop(target, TARGET, d, t, n, key, b.sampling, spec=spec,
                                  cache_size=b.cache_size)
  s = jax.jit(run)(drafter, b.tokens, b.lengths, b.key)
  assert int(s.rounds) == 1 and list(np.asarray(s.accept_hist)) == [0, 0, 1]
  assert list(np.asarray(s.tokens[0, :4])) == ar
  want = _masks_after(target, prompt + ar[:3], _mask_embedding(target, prompt, ar[:1]), k)
  np.testing.assert_allclose(np.asarray(s.draft.logits), np.asarray(want), atol=2e-4)
  np.testing.assert_allclose(np.asarray(s.draft.mask[0]), _mask_embedding(target, prompt, ar),
                             atol=1e-5)


def _one_token_run(target, cfg, engine, prompts, k, kv=None):
  """The final loop state of a probing chain or tree engine run for one token: what the prefill
  leaves (the first token, the cache, the probe's logits)."""
  spec = (SpecConfig(gamma=2, max_new_tokens=1) if engine == "chain"
          else TreeSpecConfig("dynamic:4,2,1,2", max_new_tokens=1))
  loop = speculative_loop if engine == "chain" else tree_speculative_loop
  b = prepare_batch(cfg, prompts, max_new_tokens=1, sampling=GREEDY, key=0, stop_ids=(),
                    cache_size=None, reserve=3 * (1 + k), reserve_for="the block")
  return jax.jit(lambda d, t, n, key: loop(target, cfg, d, t, n, key, b.sampling, spec=spec,
                                           cache_size=b.cache_size, kv=kv))(
      probe_drafter(target, cfg, k), b.tokens, b.lengths, b.key)


@pytest.mark.parametrize("engine", ["chain", "tree"])
def test_the_prefill_probes_after_each_prompts_last_token(target, engine):
  """Before round one the probe holds the target's logits at k masks (the prompt's mean
  embedding) after each row's last prompt token, rows of different lengths in one padded batch;
  the prefill's own logits and committed cache are those of a prefill without masks."""
  prompts, k = [PROMPTS[1], PROMPTS[0][:3], REPEATING[1]], 2
  s = _one_token_run(target, TARGET, engine, prompts, k)
  for row, prompt in enumerate(prompts):
    m = np.asarray(target.embed)[prompt].mean(0)
    want = _masks_after(target, prompt, m, k)
    np.testing.assert_allclose(np.asarray(s.draft.logits[row]), np.asarray(want[0]), atol=2e-4)
    L = len(prompt)
    _, _, alone = jitted_forward(target, TARGET, jnp.asarray([prompt]), jnp.arange(L)[None],
                                 KVCache.init(TARGET, 1, L))
    np.testing.assert_allclose(np.asarray(s.cache.k[:, row, :L]), np.asarray(alone.k[:, 0]),
                               atol=1e-4)
  first = generate(target, TARGET, prompts, max_new_tokens=1).sequences()
  assert [list(np.asarray(s.tokens[r, :1])) for r in range(3)] == first


@pytest.mark.parametrize("engine", ["chain", "tree"])
def test_under_a_budget_the_prefill_probes_after_the_kept_entries(engine):
  """Chunked prefill under StreamingLLM (budget 8, 2 sinks, chunks of 4) keeps each row's first 2
  and newest 6 prompt tokens; the probe then holds the target's logits at k masks after exactly
  those, at their original RoPE positions, and the masks at the prompt's next k positions (rows
  ending in different chunks; the short row lost nothing). One layer, so a kept entry is a
  function of its token and position alone and a from-scratch forward over the kept tokens is the
  reference. Read with the kept entries' slots as positions, the masks would see another context:
  the last assertion shows the test can tell."""
  one = dataclasses.replace(TARGET, num_layers=1)
  target = init_params(one, jax.random.key(1), scale=0.3)
  prompts, k = [PROMPTS[2] + [6], PROMPTS[0][:6], PROMPTS[2][:10]], 2
  policy = KVPolicy("streaming", budget=8, sinks=2, chunk=4, evict_every=1)
  s = _one_token_run(target, one, engine, prompts, k, policy)
  for row, prompt in enumerate(prompts):
    L = len(prompt)
    kept = list(range(L)) if L <= 8 else [0, 1] + list(range(L - 6, L))
    m = np.asarray(target.embed)[prompt].mean(0)
    want = _masks_after(target, [prompt[i] for i in kept], m, k, kept, one)
    np.testing.assert_allclose(np.asarray(s.draft.logits[row]), np.asarray(want[0]), atol=2e-4)
    if L > 8:
      slots = _masks_after(target, [prompt[i] for i in kept], m, k, cfg=one)
      assert np.abs(np.asarray(slots[0]) - np.asarray(want[0])).max() > 1e-2
  first = generate(target, one, prompts, max_new_tokens=1, kv=policy).sequences()
  assert [list(np.asarray(s.tokens[r, :1])) for r in range(3)] == first


def test_chain_tree_and_lookup_greedy_identical_to_autoregressive(target):
  ar = generate(target, TARGET, PROMPT_SET, max_new_tokens=14).sequences()
  probe = probe_drafter(target, TARGET, 3)
  for drafter in (probe, ngram_drafter(TARGET.vocab_size, fallback=probe)):
    out = speculative_generate(target, TARGET, drafter, PROMPT_SET,
                               spec=SpecConfig(gamma=3, max_new_tokens=14))
    assert out.sequences() == ar
    out = tree_speculative_generate(target, TARGET, drafter, PROMPT_SET,
                                    spec=TreeSpecConfig("dynamic:8,3,1,4", max_new_tokens=14))
    assert out.sequences() == ar


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _UnprocessedQ(ProbeDrafter):
  """The negative control: drafts drawn right, but q reported as the raw softmax (temperature,
  top-k and top-p not applied), which verification then trusts."""

  unprocessed_q: str = own_program()

  def propose(self, state, last2, seq_len, key, sampling, gamma, pick=None):
    tokens, _, state = super().propose(state, last2, seq_len, key, sampling, gamma, pick)
    return tokens, jax.nn.softmax(state.logits[:, :gamma], axis=-1), state


# T = 1.5 keeps the tiny target's 3-token law spread enough for the harness to catch the control
# (at T = 1 with this top-k / top-p it is too peaked to tell the control apart).
SAMPLED = {"chain": SamplingParams(temperature=1.5, top_k=8, top_p=0.9),
           "control": SamplingParams(temperature=1.5, top_k=8, top_p=0.9),
           "tree": SamplingParams(temperature=1.0, top_k=8, top_p=0.9)}


@pytest.mark.parametrize("kind", ["chain", "tree", "control"])
def test_sampled_probing_follows_the_target_distribution(kind):
  target = init_params(TINY, jax.random.key(10), scale=0.8)
  drafter, sp = probe_drafter(target, TINY, 2), SAMPLED[kind]
  if kind == "control":
    drafter = _UnprocessedQ(head=drafter.head, cfg=TINY, probe_masks=2)
  if kind == "tree":
    codes = sample_codes(target, drafter, "dynamic:3,2,1,2", sp, 31)
  else:
    codes = sample_sequences(target, drafter, sp, gamma=2,
                             n=2 * N_SAMPLES if kind == "control" else N_SAMPLES)
  stat, dof, ok = chi_square(codes, exact_distribution(target, sp))
  assert ok == (kind != "control"), (kind, stat, dof)


@pytest.mark.parametrize("make,match", [
    (lambda t: speculative_generate(t, TARGET, probe_drafter(t, TARGET, 2), PROMPTS[:1],
                                    spec=SpecConfig(gamma=3, max_new_tokens=4)),
     "gamma 3 drafts per round need 3 masks"),
    (lambda t: tree_speculative_generate(t, TARGET, probe_drafter(t, TARGET, 2), PROMPTS[:1],
                                         spec=TreeSpecConfig("fixed:2-2-2", max_new_tokens=4)),
     "a tree 3 deep needs 3 masks"),
    (lambda t: probe_drafter(t, TARGET, 0), "k >= 1 masks"),
])
def test_bad_probe_settings_are_refused(target, make, match):
  with pytest.raises(ValueError, match=match):
    make(target)
