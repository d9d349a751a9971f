"""The commands that make drafters and their data: distill-data, train-drafter, train-eagle,
trim-vocab, build-datastore, and eval-drafter (acceptance on held-out data)."""

from __future__ import annotations

from pathlib import Path

from jspec.cli.options import NETWORK_FLAGS, data_config, warmup_of
from jspec.cli.records import command_line, stamp_records


def cmd_train_drafter(args) -> int:
  from jspec.model import load
  from jspec.train import trainer
  from jspec.train.recipe import DrafterRecipe, train_drafter

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  recipe = DrafterRecipe(
      num_layers=args.layers, hidden_size=args.hidden_size, init=args.init,
      vocab_trim=args.vocab_trim, data_dirs=tuple(args.data or ()), save_dtype=args.save_dtype,
      data=data_config(args),
      train=trainer.TrainConfig(loss=args.loss, seq_len=args.seq_len, batch_size=args.batch_size,
                                grad_accum=args.grad_accum, steps=args.steps, lr=args.lr,
                                warmup_steps=warmup_of(args), seed=args.seed,
                                eval_every=args.eval_every,
                                checkpoint_every=args.checkpoint_every,
                                freeze_embeddings=args.freeze_embeddings))
  out = train_drafter(target, args.out, recipe, command=command_line())
  print(f"wrote {out} (load it with --drafter model:{out})")
  return 0


def cmd_train_eagle(args) -> int:
  from jspec.model import load
  from jspec.train import trainer
  from jspec.train.eagle import EagleLoss, EagleRecipe, train_eagle

  from jspec.train.eagle3 import Eagle3Loss, Eagle3Recipe, train_eagle3

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  tc = trainer.TrainConfig(loss=args.network, seq_len=args.seq_len, batch_size=args.batch_size,
                           grad_accum=args.grad_accum, steps=args.steps, lr=args.lr,
                           warmup_steps=warmup_of(args), seed=args.seed,
                           eval_every=args.eval_every, checkpoint_every=args.checkpoint_every)
  given = lambda *names: {NETWORK_FLAGS[n][1]: getattr(args, n) for n in names
                          if getattr(args, n) is not None}  # unset: the dataclasses' defaults
  common = dict(data_dirs=tuple(args.data), vocab_trim=args.vocab_trim,
                save_dtype=args.save_dtype, train=tc)
  ttt = Eagle3Loss(**given("ttt_steps", "ttt_decay"))
  if args.network == "confu":
    from jspec.train.confu import ConFuLoss, ConFuRecipe, train_confu
    recipe = ConFuRecipe(**common, **given("experts", "expert_top_k", "soft_tokens"),
                         loss=ConFuLoss(ttt=ttt, **given("anchors")))
    out = train_confu(target, args.out, recipe, command=command_line())
  elif args.network == "eagle3":
    out = train_eagle3(target, args.out, Eagle3Recipe(**common, loss=ttt), command=command_line())
  else:
    recipe = EagleRecipe(**common, loss=EagleLoss(**given("cls_weight", "unroll", "noise")))
    out = train_eagle(target, args.out, recipe, command=command_line())
  print(f"wrote {out} (load it with --drafter model:{out})")
  return 0


def cmd_distill_data(args) -> int:
  from jspec.model import load
  from jspec.train import distill
  from jspec.train.recipe import distill_texts

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  cfg = data_config(args)
  out = distill.build_dataset(target, distill_texts(cfg, args.prompt_offset), args.out, cfg)
  print(f"wrote {out} ({distill.complete_shards(out)} shards)")
  return 0


def cmd_trim_vocab(args) -> int:
  from jspec.model import load
  from jspec.train.recipe import trim_drafter

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  out = trim_drafter(target, args.drafter, tuple(args.data or ()), args.size, args.out,
                     dtype=args.save_dtype, command=command_line())
  print(f"wrote {out} (load it with --drafter model:{out})")
  return 0


def cmd_build_datastore(args) -> int:
  import numpy as np

  from jspec.io import datastore
  from jspec.io.load import load_tokenizer
  from jspec.train.distill import check_tokenizer, iter_examples

  tokenizer = load_tokenizer(args.model)
  sources = args.sources or ["sharegpt"]
  sequences = []
  for source in sources:
    if source == "sharegpt":
      sequences += datastore.sharegpt_sequences(tokenizer)
    elif Path(source).is_dir():  # the target's own answers (jspec distill-data)
      check_tokenizer(source, tokenizer)
      sequences += [ex.response for ex in iter_examples(source)]
    else:
      sequences.append(np.asarray(tokenizer.encode(Path(source).read_text(encoding="utf-8"),
                                                   add_special_tokens=False)))
  out, contexts, n_tokens = datastore.write_table(
      args.out or datastore.default_table_path(tokenizer, args.n_max, args.min_count), sequences,
      tokenizer, ",".join(sources), n_max=args.n_max, min_count=args.min_count)
  print(f"wrote {out}: {contexts} contexts from {n_tokens} tokens ({out.stat().st_size / 1e6:.1f} "
        f"MB); use it with --drafter rest:{out}")
  return 0


def cmd_eval_drafter(args) -> int:
  from jspec.bench.speed import write_records
  from jspec.drafting.registry import load_drafter
  from jspec.model import load
  from jspec.train.recipe import heldout_acceptance

  target = load(args.model, "float32-xla")  # batched training work: XLA's dot
  names = [n for n in args.drafters.split(",") if n]
  drafters = {n: load_drafter(n, target) for n in names}  # check_args: draft models only
  records = heldout_acceptance(target, drafters, tuple(args.data), seq_len=args.seq_len,
                               gamma=args.gamma)
  print(f"{'drafter':<48} {'layers':>6} {'head':>6} {'alpha_greedy':>12} {'alpha_sampled':>13} "
        f"{'tau_greedy_est':>14}")
  for r in records:
    print(f"{r['drafter']:<48} {r['draft_layers']:>6} {r['head_size']:>6} "
          f"{r['alpha_greedy']:>12.3f} {r['alpha_sampled']:>13.3f} {r['tau_greedy_est']:>14.2f}")
  if args.json:
    stamp_records(records)
    print(f"wrote {write_records(records, args.json)}")
  return 0
