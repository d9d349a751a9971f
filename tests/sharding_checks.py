"""Checks of sharded generation, run by tests/test_sharding.py in a subprocess that sees 8 CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=8; JAX reads it once, at start-up, so
the main test process cannot). `python tests/sharding_checks.py GROUP` runs one group and prints
"<GROUP>-OK"; an assertion names what differed."""

from __future__ import annotations

import re
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jspec.bench import collectives
from jspec.bench.collectives import decode_loop_collectives, program_collectives, summarize
from jspec.bench.profiling import CompileCounter
from jspec.decode import on_mesh, prepare_batch
from jspec.drafting.base import place_drafter
from jspec.drafting.lookahead import lookahead_drafter
from jspec.drafting.model import ModelDrafter
from jspec.drafting.ngram import ngram_drafter
from jspec.drafting.probe import probe_drafter
from jspec.drafting.skip import skip_drafter
from jspec.generate import generate, generate_stream, generate_tokens
from jspec.kv.policy import KVPolicy
from jspec.models.config import Config
from jspec.models.llama import init_params, repeat_kv_heads, stack_layers, step_weight_bytes
from jspec.sampling import processing
from jspec.sampling.processing import GREEDY, SamplingParams, candidate_threshold
from jspec.score import score
from jspec.sharding import Placement, kv_repeats, make_mesh, traced_under_placement
from jspec.speculative.chain import (SpecConfig, speculative_generate, speculative_generate_stream,
                                     speculative_generate_tokens)
from jspec.speculative.tree import (TreeSpecConfig, tree_speculative_generate,
                                    tree_speculative_generate_stream,
                                    tree_speculative_generate_tokens)

# 8 query heads, 2 KV heads: tp=2 shards the KV cache, tp=4 and tp=8 replicate it.
TARGET = Config(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=8, num_kv_heads=2, head_dim=8, qkv_bias=True)
DRAFT = Config(arch="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
               num_heads=2, num_kv_heads=1, head_dim=16)
# Ragged: every row a different length, one of a single token.
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [3, 3, 3, 3, 3, 3, 3], [200, 17],
           [5, 6, 5, 6, 5, 6], [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
MESHES = ((8, 1), (1, 8), (2, 4), (4, 2))  # (dp, tp)
SAMPLED = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
NUCLEUS = SamplingParams(temperature=1.5, top_p=0.9)


def models():
  # Large weights make confident logits: no near-tie a sharded sum's other rounding could flip.
  target = init_params(TARGET, jax.random.key(0), scale=0.5)
  draft = init_params(DRAFT, jax.random.key(1), scale=0.5)
  return target, draft


def same(a, b, what):
  assert a.sequences() == b.sequences(), (what, a.sequences(), b.sequences())


def check_generate():
  target, _ = models()
  # Greedy on every mesh; sampled on one splitting the rows alone and one splitting both,
  # filtered on one splitting the vocabulary 8 ways (check_trees filters on (4, 2)).
  for sp, key, meshes in ((GREEDY, 0, MESHES), (SAMPLED, 5, ((8, 1), (2, 4))),
                          (FILTERED, 7, ((1, 8),))):
    want = generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=sp, key=key)
    for dp, tp in meshes:
      got = generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=sp, key=key,
                     mesh=make_mesh(dp, tp))
      same(got, want, f"generate dp={dp} tp={tp} {sp}")
  # Few candidates (8 of 256: each of tp's shards gives its top 8): top-k 5 always fits in them,
  # top-k 40 never (the bisection runs, here on tp=4), a hot nucleus sometimes; the tokens stay
  # those of the 256-candidate runs on one device.
  few = {SamplingParams(temperature=0.8, top_k=5, top_p=0.9): ((2, 4),), FILTERED: ((2, 4),),
         NUCLEUS: ((1, 8),)}
  want = {sp: generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=sp, key=9)
          for sp in few}
  processing.CANDIDATES = 8
  jax.clear_caches()  # the constant is read when a program is traced
  try:
    for sp, meshes in few.items():
      for dp, tp in ((None, None),) + meshes:
        got = generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=sp, key=9,
                       mesh=None if dp is None else make_mesh(dp, tp))
        same(got, want[sp], f"generate, 8 candidates, dp={dp} tp={tp} {sp}")
  finally:
    processing.CANDIDATES = 256
    jax.clear_caches()
  # A KV budget (chunked prefill, eviction scored per layer, row and KV head) on a mesh too.
  for policy, meshes in ((KVPolicy("keydiff", budget=8, sinks=2, chunk=4, evict_every=1),
                          ((2, 2),)),
                         (KVPolicy("h2o", budget=8, sinks=2, chunk=4, evict_every=1), ((1, 4),))):
    want = generate(target, TARGET, PROMPTS, max_new_tokens=10, kv=policy)
    for dp, tp in meshes:
      got = generate(target, TARGET, PROMPTS, max_new_tokens=10, kv=policy,
                     mesh=make_mesh(dp, tp))
      same(got, want, f"generate kv={policy.method} dp={dp} tp={tp}")


def check_chains():
  target, draft = models()
  drafters = {"model": ModelDrafter(draft, DRAFT),  # (the lookup alone shards as in its hybrid)
              "ngram+model": ngram_drafter(256, fallback=ModelDrafter(draft, DRAFT)),
              "skip": skip_drafter(target, TARGET, (1,)), "mtp": probe_drafter(target, TARGET, 3),
              "lookahead": lookahead_drafter(target, TARGET)}
  spec = SpecConfig(gamma=3, max_new_tokens=12)
  for name, drafter in drafters.items():
    for sp, key in ((GREEDY, 0), (SAMPLED, 3)) if name in ("model", "mtp") else ((GREEDY, 0),):
      want = speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp,
                                  key=key)
      # (4, 2): check_budget_communication runs a model chain there (under a KV budget).
      meshes = ((8, 1), (1, 8), (2, 4)) if name == "model" and sp is GREEDY else ((2, 4),)
      for dp, tp in meshes:
        got = speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp,
                                   key=key, mesh=make_mesh(dp, tp))
        same(got, want, f"chain {name} dp={dp} tp={tp} {sp}")
        assert int(got.rounds) == int(want.rounds), (name, dp, tp)
  ar = generate(target, TARGET, PROMPTS, max_new_tokens=12)
  got = speculative_generate(target, TARGET, drafters["model"], PROMPTS, spec=spec,
                             mesh=make_mesh(2, 4))
  same(got, ar, "greedy chain on a mesh vs autoregressive on one device")


def check_trees():
  target, draft = models()
  fixed = TreeSpecConfig("fixed:3-2-1", max_new_tokens=12)
  dynamic = TreeSpecConfig("dynamic:6", max_new_tokens=12)  # pruned to a node budget each round
  runs = (("model", ModelDrafter(draft, DRAFT), fixed, GREEDY, 0, ((2, 4), (1, 8))),
          ("model", ModelDrafter(draft, DRAFT), dynamic, FILTERED, 13, ((4, 2),)),
          ("ngram+model", ngram_drafter(256, fallback=ModelDrafter(draft, DRAFT)), fixed, GREEDY,
           0, ((8, 1),)),
          ("mtp", probe_drafter(target, TARGET, 3), fixed, GREEDY, 0, ((4, 2),)),
          ("model", ModelDrafter(draft, DRAFT), TreeSpecConfig("rsd-s:3,3", max_new_tokens=12),
           SAMPLED, 5, ((2, 4),)))
  for name, drafter, spec, sp, key, meshes in runs:
    want = tree_speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp,
                                     key=key)
    for dp, tp in meshes:
      got = tree_speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp,
                                      key=key, mesh=make_mesh(dp, tp))
      same(got, want, f"tree {name} dp={dp} tp={tp} {sp}")


def check_compiles_once():
  target, draft = models()
  mesh = make_mesh(2, 4)
  spec = SpecConfig(gamma=3, max_new_tokens=8)
  drafter = ModelDrafter(draft, DRAFT)
  for temp in (0.0, 0.5):  # a greedy program and a sampled one (SamplingParams' static mode)
    sp = SamplingParams(temperature=temp)
    generate(target, TARGET, PROMPTS, max_new_tokens=8, sampling=sp, mesh=mesh)
    speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp, mesh=mesh)
  with CompileCounter() as counter:
    for shift, temp in ((1, 0.0), (2, 1.0)):
      prompts = [[(t + shift) % 256 for t in p] for p in PROMPTS]
      sp = SamplingParams(temperature=temp)
      jax.block_until_ready(generate(target, TARGET, prompts, max_new_tokens=8, sampling=sp,
                                     mesh=mesh, key=shift))
      jax.block_until_ready(speculative_generate(target, TARGET, drafter, prompts, spec=spec,
                                                 sampling=sp, mesh=mesh, key=shift))
  assert counter.compiles == 0, counter.compiles


def decode_step(fn, placement, *args, **static):
  """The collectives of one decode-loop iteration of engine `fn` (args: params, cfg, ...; the
  keywords static), compiled for `placement`."""
  hlo = compiled_engine(fn, placement, *args, **static).as_text()
  return decode_loop_collectives(hlo, placement.mesh.size)


def check_communication():
  """The decode step under tp communicates what Megatron's split needs and nothing more: two
  all-reduces of [B/dp, 1, E] a layer plus one for the embedding lookup (vocabulary-sharded
  table), scalars for the greedy pick; under dp alone only the loop's exit test."""
  target, draft = models()
  for dp, tp in ((2, 4), (8, 1), (1, 8)):
    b = prepare_batch(TARGET, PROMPTS, max_new_tokens=8, sampling=GREEDY, key=0, stop_ids=(),
                      cache_size=None)
    placed, b, placement = on_mesh(target, TARGET, b, make_mesh(dp, tp))
    wq = placed.layers[0].wq  # [E, H, D]: heads over tp, one shard a device
    assert wq.sharding.spec == PartitionSpec(None, "tp", None), wq.sharding
    assert {s.data.shape for s in wq.addressable_shards} == {(64, 8 // tp, 8)}
    kv_split = tp if TARGET.num_kv_heads % tp == 0 else 1  # fewer KV heads than tp: replicated
    assert placed.layers[0].wk.addressable_shards[0].data.shape == (64, 2 // kv_split, 8)
    # What one device streams a step: its shards (a bandwidth fraction is one device's).
    whole = step_weight_bytes(target, TARGET.vocab_size)
    on_one = step_weight_bytes(placed, TARGET.vocab_size)
    assert on_one == whole if tp == 1 else on_one < 2 * whole // tp, (dp, tp, on_one, whole)
    step = decode_step(generate_tokens, placement, placed, TARGET, b.tokens, b.lengths, b.key,
                       b.sampling, max_new_tokens=8, cache_size=b.cache_size)
    big = [c for c in step if not c.in_branch and c.bytes > 64]
    rows = len(PROMPTS) // dp
    if tp == 1:
      assert not big, (dp, tp, big)
    else:
      assert sorted({(c.op, c.bytes) for c in big}) == [("all-reduce", rows * 64 * 4)], big
      assert len(big) == 2 * TARGET.num_layers + 1, (len(big), summarize(step))
    assert not any(c.op == "all-gather" and c.bytes >= rows * 256 * 4 // max(tp, 2)
                   for c in step if not c.in_branch), ("logits gathered", summarize(step))
    # A chain round: the verification's 2L + 1 all-reduces of [B/dp, gamma + 1, E]; the
    # replicated draft model adds none, and under dp nothing moves but the exit test.
    spec = SpecConfig(gamma=3, max_new_tokens=8)
    drafter = place_drafter(ModelDrafter(draft, DRAFT), placement, target, placed)
    step = decode_step(speculative_generate_tokens, placement, placed, TARGET, drafter, b.tokens,
                       b.lengths, b.key, b.sampling, spec=spec, cache_size=b.cache_size + 8)
    big = [c for c in step if not c.in_branch and c.bytes > (64 if tp == 1 else 512)]
    if tp == 1:
      assert not big, (dp, tp, big)
    else:
      assert sorted({(c.op, c.bytes) for c in big}) == [("all-reduce", rows * 4 * 64 * 4)], big
      assert len(big) == 2 * TARGET.num_layers + 1, big


def check_round_communication():
  """A speculative round under dp alone moves nothing but the loop's exit test and counters, for
  every drafter family and tree kind: each device reads and writes its own rows (sharding.get_rows,
  set_rows, top_k_by_rows). With explicit row indices XLA's partitioner all-gathered the indices
  of every row-indexed scatter and gather: 12 collectives a fixed tree round, 21 with an n-gram
  drafter, a top_k's [B, V] logits under top-k/top-p. Under tp a drafter's vocabulary-split
  log-probs give the tree only each shard's best children (a probing tree gathered [B/dp, W, V]
  at each depth, and so did a stochastic beam's choice over all W x V children)."""
  target, draft = models()
  fixed = TreeSpecConfig("fixed:3-2-1", max_new_tokens=8)
  spec = SpecConfig(gamma=3, max_new_tokens=8)
  runs = (  # (drafter, tree or chain, sampling, mesh)
      (ModelDrafter(draft, DRAFT), fixed, GREEDY, (8, 1)),
      (ngram_drafter(256, fallback=ModelDrafter(draft, DRAFT)), fixed, GREEDY, (8, 1)),
      (ngram_drafter(256, fallback=ModelDrafter(draft, DRAFT)), spec, GREEDY, (8, 1)),
      (lookahead_drafter(target, TARGET), spec, GREEDY, (8, 1)),
      (ModelDrafter(draft, DRAFT), TreeSpecConfig("dynamic:6", max_new_tokens=8), FILTERED,
       (8, 1)),
      (ModelDrafter(draft, DRAFT), spec, FILTERED, (8, 1)),
      (probe_drafter(target, TARGET, 3), fixed, GREEDY, (2, 4)),
      (ModelDrafter(draft, DRAFT), TreeSpecConfig("dynamic:6", max_new_tokens=8), GREEDY, (2, 4)),
      (ModelDrafter(draft, DRAFT), TreeSpecConfig("rsd-s:3,3", max_new_tokens=8), SAMPLED,
       (2, 4)))
  for drafter, shape, sp, (dp, tp) in runs:
    b = prepare_batch(TARGET, PROMPTS, max_new_tokens=8, sampling=sp, key=0, stop_ids=(),
                      cache_size=None)
    placed, b, placement = on_mesh(target, TARGET, b, make_mesh(dp, tp))
    placed_drafter = place_drafter(drafter, placement, target, placed)
    tree = isinstance(shape, TreeSpecConfig)
    step = decode_step(tree_speculative_generate_tokens if tree else speculative_generate_tokens,
                       placement, placed, TARGET, placed_drafter, b.tokens, b.lengths, b.key,
                       b.sampling, spec=shape,
                       cache_size=b.cache_size + (shape.reserve if tree else 8))
    what = (type(drafter).__name__, shape, sp, dp, tp, summarize(step))
    if tp == 1:
      assert all(c.op == "all-reduce" and c.bytes <= 64 for c in step), what
    else:  # besides all-reduces only the children's candidates: values and indices, 3 depths
      rows = len(PROMPTS) // dp  # (sampled trees move two more, of 64 bytes)
      moved = [c for c in step if c.op != "all-reduce"]
      assert len(moved) <= 8 and sum(c.bytes for c in moved) < rows * TARGET.vocab_size * 4, what


def compiled_engine(fn, placement, *args, **static):
  """Engine `fn` (args: params, cfg, ...; the keywords static) compiled for `placement`."""
  return collectives.compiled_engine(fn, *args, placement=placement, **static)


def moved(hlo: str, placement) -> list[tuple[str, int]]:
  """(op, bytes) of every collective but the all-reduces in a whole program."""
  return sorted((c.op, c.bytes) for c in program_collectives(hlo, placement.mesh.size)
                if c.op != "all-reduce")


def check_budget_communication():
  """A KV budget adds no collective: every layer, row and KV head evicts on its own, so each
  device evicts its own rows (and KV heads where tp splits them). XLA's partitioner, left to
  itself, gathered every row's scores and moved entries to every device (16 all-gathers in the
  HLO of generate under dp=8). Chains and trees on a mesh under a budget equal one device's."""
  target, draft = models()
  keydiff = KVPolicy("keydiff", budget=8, sinks=2, chunk=4, evict_every=1)
  caote = KVPolicy("h2o+caote", budget=8, sinks=2, chunk=4, evict_every=1)
  spec = SpecConfig(gamma=3, max_new_tokens=8)
  for dp, tp in ((8, 1), (4, 2)):
    b = prepare_batch(TARGET, PROMPTS, max_new_tokens=8, sampling=GREEDY, key=0, stop_ids=(),
                      cache_size=None)
    placed, b, placement = on_mesh(target, TARGET, b, make_mesh(dp, tp))
    common = (b.tokens, b.lengths, b.key, b.sampling)
    policies = (keydiff, caote) if tp == 1 else (keydiff,)
    engines = [("generate", generate_tokens, (placed, TARGET) + common,
                dict(max_new_tokens=8, cache_size=b.cache_size), policies)]
    if dp == 8:  # the chain's and tree's eviction is the same function (evict_when_full)
      drafter = place_drafter(ModelDrafter(draft, DRAFT), placement, target, placed)
      engines.append(("chain", speculative_generate_tokens, (placed, TARGET, drafter) + common,
                      dict(spec=spec, cache_size=b.cache_size + 8), (keydiff,)))
    for name, fn, args, static, policies in engines:
      plain = moved(compiled_engine(fn, placement, *args, kv=None, **static).as_text(), placement)
      for policy in policies:
        got = moved(compiled_engine(fn, placement, *args, kv=policy, **static).as_text(),
                    placement)
        assert got == plain, (name, policy.method, dp, tp, got, plain)
  # The drafter's own budget too: its one KV head stays whole where tp=2 splits the target's two.
  want = speculative_generate(target, TARGET, ModelDrafter(draft, DRAFT), PROMPTS, spec=spec,
                              kv=keydiff, draft_kv=keydiff)
  got = speculative_generate(target, TARGET, ModelDrafter(draft, DRAFT), PROMPTS, spec=spec,
                             kv=keydiff, draft_kv=keydiff, mesh=make_mesh(4, 2))
  same(got, want, "chain kv=draft_kv=keydiff dp=4 tp=2")
  # A tree under dp: the same tokens, and the drafter's top-k children taken by each device from
  # its own rows (sharding.top_k_by_rows; XLA gathered every row's [B, W, V] draft log-probs).
  tree = TreeSpecConfig("fixed:3-2-1", max_new_tokens=8)
  want = tree_speculative_generate(target, TARGET, ModelDrafter(draft, DRAFT), PROMPTS, spec=tree,
                                   kv=caote)
  b = prepare_batch(TARGET, PROMPTS, max_new_tokens=8, sampling=GREEDY, key=0, stop_ids=(),
                    cache_size=None)
  placed, b, placement = on_mesh(target, TARGET, b, make_mesh(8, 1))
  drafter = place_drafter(ModelDrafter(draft, DRAFT), placement, target, placed)
  program = compiled_engine(tree_speculative_generate_tokens, placement, placed, TARGET, drafter,
                            b.tokens, b.lengths, b.key, b.sampling, spec=tree,
                            cache_size=b.cache_size + tree.reserve, kv=caote)
  gathered = re.findall(r'all-gather[-start]*\([^\n]*op_name="([^"]*)"', program.as_text())
  assert not [name for name in gathered if name.endswith("top_k")], gathered
  same(program(placed, drafter, b.tokens, b.lengths, b.key, b.sampling), want,
       "tree kv=h2o+caote dp=8 tp=1")


def check_filtered_sampling_moves_candidates():
  """top-k/top-p on vocabulary-sharded logits: each device takes the top CANDIDATES of its own
  shard, so the threshold moves tp * CANDIDATES values a row, not the V logits (the control:
  off an engine's placement, XLA gathers whole rows to run top_k)."""
  mesh = make_mesh(2, 4)
  rows, V = 8, 8192
  x = jax.device_put(np.random.default_rng(0).normal(size=(rows, V)).astype(np.float32),
                     NamedSharding(mesh, PartitionSpec("dp", "tp")))
  k, p = np.full((rows, 1), 40, np.int32), np.full((rows, 1), 0.9, np.float32)
  threshold = traced_under_placement(lambda x, k, p, placement=None: candidate_threshold(x, k, p))
  moved = {}
  for placement in (Placement(mesh), None):
    hlo = jax.jit(threshold, static_argnames="placement").lower(
        x, k, p, placement=placement).compile().as_text()
    moved[placement is not None] = max(
        (c.bytes for c in program_collectives(hlo, mesh.size) if c.op != "all-reduce"), default=0)
  local_rows = rows // 2
  assert 0 < moved[True] <= local_rows * 4 * processing.CANDIDATES * 4, moved
  assert moved[False] >= local_rows * V * 4, moved  # the control
  # In a decode step (SamplingParams' static mode: no greedy/sampled or filters-on switch), the
  # bisection past the candidates is one lax.cond deep: it moves [B/dp, 1] sums, never a row.
  cfg = Config(arch="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
               num_heads=4, num_kv_heads=4, head_dim=8)
  b = prepare_batch(cfg, PROMPTS, max_new_tokens=8, sampling=FILTERED, key=0, stop_ids=(),
                    cache_size=None)
  placed, b, placement = on_mesh(init_params(cfg, jax.random.key(0)), cfg, b, mesh)
  step = decode_step(generate_tokens, placement, placed, cfg, b.tokens, b.lengths, b.key,
                     b.sampling, max_new_tokens=8, cache_size=b.cache_size)
  gathers = [c for c in step if c.op != "all-reduce"]
  assert max(c.bytes for c in gathers) <= local_rows * 4 * 256 * 4, gathers
  bisection = [c for c in step if c.depth == 1]
  assert bisection and all(c.op == "all-reduce" and c.bytes <= 2 * local_rows * 4
                           for c in bisection), bisection  # (pairs fused into one tuple)


def check_repeated_kv_heads():
  """tp over more devices than KV heads: each KV head repeated tp / K times (the same tokens on
  one device), then one KV head and one cache shard a device, and still only Megatron's
  collectives."""
  target, _ = models()
  want = generate(target, TARGET, PROMPTS, max_new_tokens=10)
  for dp, tp in ((2, 4),):  # each KV head twice (tp=8 repeats it 4 times: the same code)
    mesh = make_mesh(dp, tp)
    params, cfg = repeat_kv_heads(target, TARGET, kv_repeats(TARGET, mesh))
    assert cfg.num_kv_heads == tp
    same(generate(params, cfg, PROMPTS, max_new_tokens=10), want, f"repeated x{tp // 2}")
    b = prepare_batch(cfg, PROMPTS, max_new_tokens=8, sampling=GREEDY, key=0, stop_ids=(),
                      cache_size=None)
    placed, b, placement = on_mesh(params, cfg, b, mesh)
    assert placement.rules.kv_heads == "tp"
    assert {s.data.shape for s in placed.layers[0].wk.addressable_shards} == {(64, 1, 8)}
    same(generate(placed, cfg, PROMPTS, max_new_tokens=10, mesh=mesh), want, f"dp={dp} tp={tp}")
    # Attention-scored eviction: every copy of a KV head scores (and evicts) as the one head.
    h2o = KVPolicy("h2o", budget=8, sinks=2, chunk=4, evict_every=1)
    same(generate(placed, cfg, PROMPTS, max_new_tokens=10, kv=h2o, mesh=mesh),
         generate(target, TARGET, PROMPTS, max_new_tokens=10, kv=h2o), f"h2o dp={dp} tp={tp}")
    drafter = skip_drafter(params, cfg, (1,))  # unplaced: place_drafter maps it to `placed`
    got = speculative_generate(params, cfg, drafter, PROMPTS, mesh=mesh,
                               spec=SpecConfig(gamma=3, max_new_tokens=10))
    same(got, want, f"skip chain, repeated KV heads, dp={dp} tp={tp}")
    step = decode_step(generate_tokens, placement, placed, cfg, b.tokens, b.lengths, b.key,
                       b.sampling, max_new_tokens=8, cache_size=b.cache_size)
    big = [c for c in step if not c.in_branch and c.bytes > 64]
    assert len(big) == 2 * cfg.num_layers + 1 and {c.op for c in big} == {"all-reduce"}, big


def check_stacked_layers():
  """Stacked layers (one lax.scan) on meshes: the layer axis stays whole on every device, each
  layer's heads split over tp as unstacked ones do, and the tokens are one device's."""
  target, draft = models()
  stacked = stack_layers(target)
  want = generate(stacked, TARGET, PROMPTS, max_new_tokens=10)
  same(want, generate(target, TARGET, PROMPTS, max_new_tokens=10), "stacked vs unrolled")
  for dp, tp in ((2, 4), (1, 8)):
    mesh = make_mesh(dp, tp)
    same(generate(stacked, TARGET, PROMPTS, max_new_tokens=10, mesh=mesh), want,
         f"stacked dp={dp} tp={tp}")
  b = prepare_batch(TARGET, PROMPTS, max_new_tokens=8, sampling=GREEDY, key=0, stop_ids=(),
                    cache_size=None)
  placed, _, _ = on_mesh(stacked, TARGET, b, make_mesh(1, 2))
  # wq [L, E, H, D]: all layers, every embedding row, half the heads on each of tp=2 devices.
  assert {s.data.shape for s in placed.layers.wq.addressable_shards} == {(2, 64, 4, 8)}
  drafters = {"model": ModelDrafter(stack_layers(draft), DRAFT),
              "skip": skip_drafter(stacked, TARGET, (1,))}
  for name, drafter in drafters.items():
    got = speculative_generate(stacked, TARGET, drafter, PROMPTS, mesh=make_mesh(2, 4),
                               spec=SpecConfig(gamma=3, max_new_tokens=10))
    same(got, want, f"stacked chain {name} dp=2 tp=4")


def check_streams():
  """Streamed runs on a mesh (state sharded as the whole run's, read between segments) make the
  tokens the whole run makes on one device, and compile each segment program once (the start's
  state and a segment's were sharded apart: the second segment compiled the program again)."""
  with CompileCounter() as counter:
    streams()
  segments = [name for name in counter.programs if "segment" in name]
  assert len(segments) == len(set(segments)) == 3, counter.programs


def streams():
  target, draft = models()
  want = generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=SAMPLED, key=5)
  stream = generate_stream(target, TARGET, PROMPTS, max_new_tokens=10, sampling=SAMPLED, key=5,
                           mesh=make_mesh(2, 4), every=3)
  rows = [sum(parts, []) for parts in zip(*stream)]
  assert rows == want.sequences(), (rows, want.sequences())
  same(stream.output, want, "generate streamed dp=2 tp=4")
  drafter = ModelDrafter(draft, DRAFT)
  spec = SpecConfig(gamma=3, max_new_tokens=12)
  want = speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, sampling=SAMPLED, key=3)
  stream = speculative_generate_stream(target, TARGET, drafter, PROMPTS, spec=spec,
                                       sampling=SAMPLED, key=3, mesh=make_mesh(4, 2))
  assert [sum(parts, []) for parts in zip(*stream)] == want.sequences()
  same(stream.output, want, "chain streamed dp=4 tp=2")
  # A row halted by the reader (a stop string) on a mesh: the others run on unchanged (the same
  # programs: a halt is state the reader sets between segments).
  stream = speculative_generate_stream(target, TARGET, drafter, PROMPTS, spec=spec,
                                       sampling=SAMPLED, key=3, mesh=make_mesh(4, 2))
  for i, _ in enumerate(stream):
    if i == 0:
      stream.halt([2, 5])
  got, whole = stream.output.sequences(), want.sequences()
  for row in range(len(PROMPTS)):
    assert got[row] == (whole[row][:len(got[row])] if row in (2, 5) else whole[row]), row
  assert len(got[5]) < len(whole[5]), (got[5], whole[5])
  spec = TreeSpecConfig("fixed:3-2-1", max_new_tokens=12)
  want = tree_speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec)
  stream = tree_speculative_generate_stream(target, TARGET, drafter, PROMPTS, spec=spec,
                                            mesh=make_mesh(1, 8))
  list(stream)
  same(stream.output, want, "tree streamed dp=1 tp=8")


def check_penalties_and_logprobs():
  """Repetition / presence / frequency penalties (the history's [B, V] counts, the path tokens'
  gather and scatter) and token log-probabilities (a logsumexp, a processed-logprob filter and a
  gather across shards) over a vocabulary split by tp give one device's tokens and log-probs,
  every engine; so do settings given per row (greedy rows beside sampled ones) with the rows
  split by dp; and so does scoring text, with a full cache and under a budget."""
  target, draft = models()
  drafter = ModelDrafter(draft, DRAFT)
  close = lambda a, b, what: np.testing.assert_allclose(np.asarray(a.logprobs),
                                                        np.asarray(b.logprobs), atol=1e-4,
                                                        err_msg=what)
  greedy = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.5)
  sampled = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.2,
                           presence_penalty=0.5)
  B = len(PROMPTS)
  rows = SamplingParams(temperature=np.arange(B) % 3 * 0.5, top_k=np.arange(B) % 2 * 20,
                        repetition_penalty=1 + np.arange(B) % 4 * 0.1)
  assert rows.mode.greedy_rows
  for sp, key, logprobs, meshes in ((greedy, 0, None, ((1, 8),)),
                                    (sampled, 5, "sampled", ((2, 4),)),
                                    (rows, 6, "model", ((2, 4),))):
    want = generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=sp, key=key,
                    logprobs=logprobs)
    assert want.sequences() != generate(target, TARGET, PROMPTS, max_new_tokens=10,
                                        key=key).sequences()
    for dp, tp in meshes:
      got = generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=sp, key=key,
                     logprobs=logprobs, mesh=make_mesh(dp, tp))
      same(got, want, f"generate dp={dp} tp={tp} {sp}")
      if logprobs:
        close(got, want, f"generate dp={dp} tp={tp} logprobs={logprobs}")
  # The rows' settings (greedy rows beside sampled ones, each filtered or not) in both engines;
  # the chain also all rows sampled, the tree all greedy (the same tokens as generate's).
  ar = generate(target, TARGET, PROMPTS, max_new_tokens=12, sampling=greedy)
  for spec, run, settings in ((SpecConfig(gamma=3, max_new_tokens=12, logprobs="sampled"),
                               speculative_generate, (sampled, rows)),
                              (TreeSpecConfig("fixed:3-2-1", max_new_tokens=12, logprobs="model"),
                               tree_speculative_generate, (greedy, rows))):
    for sp in settings:
      want = run(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp, key=3)
      if sp is greedy:
        same(want, ar, f"{run.__name__} == generate")
      else:
        assert np.any(np.asarray(want.logprobs) < 0)
      got = run(target, TARGET, drafter, PROMPTS, spec=spec, sampling=sp, key=3,
                mesh=make_mesh(2, 4))
      same(got, want, f"{run.__name__} {sp}")
      close(got, want, f"{run.__name__} logprobs={spec.logprobs} {sp}")
  for kv in (None, KVPolicy("keydiff", budget=8, sinks=2, chunk=4, evict_every=1)):
    want = score(target, TARGET, PROMPTS, chunk=4, kv=kv)
    got = score(target, TARGET, PROMPTS, chunk=4, kv=kv, mesh=make_mesh(2, 4))
    close(got, want, f"score kv={kv}")


GROUPS = {"generate": check_generate, "streams": check_streams, "chains": check_chains,
          "trees": check_trees, "penalties": check_penalties_and_logprobs,
          "compiles": check_compiles_once, "communication": check_communication,
          "rounds": check_round_communication,
          "budget": check_budget_communication,
          "repeat": check_repeated_kv_heads, "filters": check_filtered_sampling_moves_candidates,
          "stacked": check_stacked_layers}

if __name__ == "__main__":
  assert len(jax.devices()) == 8, jax.devices()
  for group in sys.argv[1:]:
    GROUPS[group]()
    print(f"{group}-OK", flush=True)
