"""The `jspec` command end to end on a tiny local model: generate, bench JSON, clear errors."""

import json

import jax
import pytest

pytest.importorskip("transformers")

import ggufutil  # noqa: E402
from jspec.cli import main  # noqa: E402

BENCH_FIELDS = {"method", "model", "dataset", "temperature", "n_prompts", "new_tokens",
                "target_calls", "tokens_per_s", "wall_s", "machine", "ttft_s",
                "decode_tokens_per_s"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama",
                                        max_position_embeddings=2048)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  return d


def test_generate(tiny_model, capsys):
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Why is the sky blue?",
               "--prompt", "Hi", "--max-new-tokens", "5", "--temperature", "0.8",
               "--top-p", "0.9", "--min-p", "0.05"]) == 0
  captured = capsys.readouterr()
  assert captured.out.count("### ") == 2
  assert "tokens/s" in captured.err
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--temperature", "1",
               "--min-p", "1.5"]) == 2
  assert "--min-p must be in [0, 1]" in capsys.readouterr().err


def test_generate_takes_sampling_settings_per_prompt(tiny_model, capsys):
  argv = ["generate", "--model", str(tiny_model), "--prompt", "Why is the sky blue?",
          "--prompt", "Hi", "--max-new-tokens", "6", "--seed", "3"]
  assert main(argv + ["--temperature", "0,0.9", "--top-k", "0,5",
                      "--repetition-penalty", "1.3,1"]) == 0
  both = capsys.readouterr().out.split("### ")[1:]
  assert main(argv + ["--repetition-penalty", "1.3"]) == 0  # greedy, for the first row
  greedy = capsys.readouterr().out.split("### ")[1:]
  assert both[0] == greedy[0]  # the greedy row is the greedy run's
  assert main(argv + ["--temperature", "0,0.5,1"]) == 2
  assert "temperature must be one number for the whole batch or one per row (2, one per " \
         "prompt)" in capsys.readouterr().err
  assert main(["bench", "--model", str(tiny_model), "--temperature", "0,1"]) == 2
  assert "--temperature takes one number in `jspec bench`" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # argparse: not a number
    main(argv + ["--top-k", "0,x"])
  assert "invalid int value: '0,x'" in capsys.readouterr().err
  assert main(argv + ["--presence-penalty=-0.5,0.5", "--temperature", "0.7"]) == 0  # the help's way
  capsys.readouterr()
  for command in (["generate", "--prompt", "a", "--prompt", "b", "--drafter", "self",
                   "--gamma", "auto"], ["bench-tau", "--drafter", "self", "--tree", "fixed:2"]):
    assert main(command + ["--model", str(tiny_model), "--temperature", "0,1"]) == 2
    err = capsys.readouterr().err  # refused by check_args, before anything loads
    assert "--gamma auto calibrates under one setting" in err or (
        "--temperature takes one number in `jspec bench-tau`" in err), err


def test_generate_streams_the_same_text(tiny_model, capsys):
  argv = ["generate", "--model", str(tiny_model), "--prompt", "Why is the sky blue?",
          "--max-new-tokens", "12", "--temperature", "0.8", "--drafter", "self", "--gamma", "2"]
  assert main(argv) == 0
  whole = capsys.readouterr().out
  assert main(argv + ["--stream"]) == 0
  captured = capsys.readouterr()
  assert captured.out == whole and "tokens/s" in captured.err
  assert main(argv + ["--stream", "--prompt", "Hi"]) == 2
  assert "--stream prints one prompt's text" in capsys.readouterr().err


def test_generate_reports_logprobs(tiny_model, capsys):
  argv = ["generate", "--model", str(tiny_model), "--prompt", "Why is the sky blue?",
          "--prompt", "Hi", "--max-new-tokens", "6", "--drafter", "self", "--gamma", "2"]
  assert main(argv) == 0
  plain = capsys.readouterr()
  assert "logprobs" not in plain.err
  assert main(argv + ["--logprobs", "model"]) == 0
  got = capsys.readouterr()
  assert got.out == plain.out  # the same answers, scored
  lines = [line for line in got.err.splitlines() if "logprobs (model)" in line]
  assert len(lines) == 2 and all("6 tokens, sum -" in line for line in lines), got.err
  assert main(argv + ["--logprobs", "sampled"]) == 0  # greedy: each token drawn with prob. 1
  assert "6 tokens, sum 0.000, mean 0.000 (perplexity 1.000)" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    main(argv + ["--logprobs", "raw"])


@pytest.mark.parametrize("stream", [False, True])
def test_generate_stops_at_stop_text(tiny_model, capsys, stream):
  argv = ["generate", "--model", str(tiny_model), "--prompt", "Why is the sky blue?",
          "--max-new-tokens", "40", "--temperature", "1", "--no-chat"] + (["--stream"] * stream)
  assert main(argv) == 0
  full = capsys.readouterr().out[:-1]  # less the newline print adds
  stop = full[12:15]
  escaped = stop.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
  assert main(argv + ["--stop", escaped, "--stop", "never seen", "--logprobs", "model"]) == 0
  got = capsys.readouterr()
  assert got.out == full[:full.index(stop)] + "\n"
  # The answer's tokens are scored, not those the run made past its stop text.
  scored = int(got.err.split("of answer 1: ")[1].split(" tokens")[0])
  made = int(got.err.split(" tokens in ")[0].split()[-1])
  assert scored < made <= 40
  assert main(argv + ["--stop", ""]) == 2
  assert "--stop is empty" in capsys.readouterr().err
  # A special token's text never shows in decoded text: refused as the API refuses it (it ran on,
  # never matched).
  assert main(argv + ["--stop", "<|im_start|>"]) == 2
  assert "holds the special token '<|im_start|>' (id 1)" in capsys.readouterr().err
  # A stop string opening the answer: nothing to score, said without dividing by zero.
  opening = full[:2].replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
  assert main(argv + ["--stop", opening, "--logprobs", "model"]) == 0
  got = capsys.readouterr()
  assert got.out == "\n" and "of answer 1: 0 tokens" in got.err, got.err


def test_score_prints_each_texts_log_probability(tiny_model, tmp_path, capsys):
  doc = tmp_path / "doc.txt"
  doc.write_text(" ".join(["the sky is blue because of Rayleigh scattering"] * 8))
  assert main(["score", "--model", str(tiny_model), "--text", "Why is the sky blue?",
               "--file", str(doc)]) == 0
  full = capsys.readouterr().out.splitlines()
  assert len(full) == 2 and full[0].startswith("text 1: ") and full[1].startswith(f"{doc}: ")
  assert all("perplexity" in line for line in full)
  assert main(["score", "--model", str(tiny_model), "--file", str(doc), "--kv-budget", "24",
               "--kv-chunk", "8"]) == 0
  budgeted = capsys.readouterr()
  assert "KV budget 24 a row (keydiff" in budgeted.err
  assert budgeted.out.splitlines()[0] != full[1]  # the budget changed the scores of a long text
  assert main(["score", "--model", str(tiny_model)]) == 2
  assert "--text TEXT or --file PATH" in capsys.readouterr().err
  assert main(["score", "--model", str(tiny_model), "--file", str(tmp_path / "none.txt")]) == 2


def test_generate_under_a_kv_budget(tiny_model, capsys):
  long_prompt = " ".join(["the sky is blue because of Rayleigh scattering"] * 12)
  assert main(["generate", "--model", str(tiny_model), "--prompt", long_prompt,
               "--max-new-tokens", "20", "--kv-budget", "24", "--kv-policy", "h2o+caote",
               "--kv-chunk", "8", "--drafter", "self", "--gamma", "2"]) == 0
  # (--kv-drafter auto: the drafter's cache by keydiff, as h2o needs attention it cannot record;
  # 20 tokens: decoding evicts once at the default cadence, which lets whole rounds through)
  err = capsys.readouterr().err
  assert "tokens/s" in err and "lets whole rounds" not in err
  # The policy as it ran, H2O's default window included: 32, at most (24 - 4) // 2.
  assert "KV budget 24 a row (h2o+caote: sinks 4, window 10, chunk 8, evict every 16)" in err
  # A budget that leaves nothing to choose: one clear line, exit 2, nothing loaded.
  assert main(["generate", "--model", str(tiny_model), "--prompt", "x", "--kv-budget", "4",
               "--kv-sinks", "4"]) == 2
  assert "exceed sinks + window" in capsys.readouterr().err
  # A chunk asked for beyond the budget is refused, not shrunk (the default shrinks to fit).
  assert main(["generate", "--model", str(tiny_model), "--prompt", "x", "--kv-budget", "16",
               "--kv-chunk", "32"]) == 2
  assert "--kv-chunk 32 is larger than --kv-budget 16" in capsys.readouterr().err


@pytest.fixture
def transformers_on_cpu(monkeypatch):
  """transformers beside jspec on the CPU in float32 whatever the machine (on CUDA it would also
  add a static-cache record: tests/test_bench.py covers the placement)."""
  monkeypatch.setattr("jspec.bench.speed.torch_placement", lambda model: ("cpu", "float32"))


def test_bench_writes_records(tiny_model, tmp_path, capsys, transformers_on_cpu, monkeypatch):
  import jax
  from jspec.bench import speed
  timed = []  # (method, prompt length), in the order the prompts were timed

  def recording(cls, name):
    original = cls.time_prompt
    def time_prompt(self, run, p):
      timed.append((name, len(p)))
      return original(self, run, p)
    monkeypatch.setattr(cls, "time_prompt", time_prompt)
  recording(speed.Method, "jspec")
  recording(speed.TransformersMethod, "transformers")
  out = tmp_path / "bench.json"
  assert main(["bench", "--model", str(tiny_model), "--dataset", "humaneval", "--num-prompts", "2",
               "--max-new-tokens", "6", "--json", str(out)]) == 0
  # transformers is timed side by side with jspec, prompt by prompt (it once ran after jspec's
  # runs, so a machine that slowed midway landed in the ratio).
  assert [name for name, _ in timed[:4]] == ["jspec", "transformers"] * 2
  assert timed[0][1] == timed[1][1] and timed[2][1] == timed[3][1]
  records = json.loads(out.read_text())
  assert [r["method"] for r in records] == ["jspec-autoregressive", "transformers-generate"]
  for r in records:
    assert BENCH_FIELDS <= set(r), BENCH_FIELDS - set(r)
    assert r["n_prompts"] == 2 and 2 <= r["new_tokens"] <= 12 and r["tokens_per_s"] > 0
  assert records[1]["identical_to_jspec"] == 1.0  # greedy: same tokens as transformers
  assert records[0]["compile_s"] > 0 and records[0]["speedup_vs_transformers"] > 0
  # transformers runs where JAX runs (here the CPU), in jspec's dtype; both say so.
  assert (records[1]["torch_device"], records[1]["torch_dtype"], records[1]["cache"]) == (
      "cpu", "float32", "dynamic")
  assert records[0]["matmul_precision"] == str(jax.config.jax_default_matmul_precision or "default")
  assert records[0]["machine"]["backend"] == jax.default_backend()
  assert records[0]["bandwidth"]["copy_gbps"] > 0


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "4000"], "more than the model's max_position_embeddings=2048"),
])
def test_bad_arguments_exit_cleanly(tiny_model, capsys, args, message):
  code = main(["generate", "--model", str(tiny_model), "--prompt", "hello"] + args)
  assert code == 2
  assert message in capsys.readouterr().err


def test_missing_model(capsys, tmp_path):
  assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
  assert "never downloads" in capsys.readouterr().err


def test_bench_speculative_records(tiny_model, tmp_path):
  out = tmp_path / "spec.json"
  assert main(["bench", "--model", str(tiny_model), "--dataset", "mt-bench", "--num-prompts", "1",
               "--max-new-tokens", "9", "--drafter", "self", "--gamma", "3", "--no-transformers",
               "--json", str(out)]) == 0
  ar, spec = json.loads(out.read_text())
  assert (ar["method"], spec["method"]) == ("jspec-autoregressive", "jspec-speculative")
  assert spec["drafter"] == "self" and spec["gamma"] == 3
  assert spec["identical_to_ar"] == 1.0  # greedy speculative == greedy autoregressive
  assert 1.0 <= spec["block_efficiency"] <= 4.0
  assert spec["target_calls"] < ar["target_calls"]  # the point of speculating
  for key in ("speedup_vs_ar", "ar_tokens_per_s", "engine_overhead", "round_components_s"):
    assert key in spec
  assert spec["accepted_per_round"] == 4.0  # the self drafter: every draft accepted (gamma + 1)
  assert sum(spec["accept_hist"][:-1]) == 0
  split = spec["round_split_s"]  # where a round's time goes, piece by piece
  assert set(split) == {"draft_layers", "draft_head", "verify_layers", "verify_head", "ar_step"}
  assert all(v > 0 for v in split.values())


def test_int8_weights(tiny_model, capsys):
  assert main(["generate", "--model", str(tiny_model), "--weights", "int8", "--prompt", "Hi",
               "--max-new-tokens", "12"]) == 0
  assert capsys.readouterr().out.strip()
  assert main(["generate", "--model", str(tiny_model), "--weights", "int8", "--prompt", "Hi",
               "--max-new-tokens", "12", "--drafter", "self"]) == 0
  assert capsys.readouterr().out.strip()
  # An int8 target with a q4 copy of itself drafting (model:PATH reads --drafter-weights; `self`
  # drafts with the target's own weights, and refuses the flag): output identical to int8 decoding.
  assert main(["generate", "--model", str(tiny_model), "--weights", "int8", "--prompt", "Hi",
               "--max-new-tokens", "12", "--no-chat"]) == 0
  plain = capsys.readouterr().out
  assert main(["generate", "--model", str(tiny_model), "--weights", "int8", "--prompt", "Hi",
               "--max-new-tokens", "12", "--no-chat", "--drafter", f"model:{tiny_model}",
               "--drafter-weights", "q4"]) == 0
  assert capsys.readouterr().out == plain
  assert main(["generate", "--model", str(tiny_model), "--weights", "q4", "--prompt", "Hi",
               "--max-new-tokens", "12"]) == 0
  assert capsys.readouterr().out.strip()
  # Trees over an int8 target on jspec's CPU kernels: the int8 output; on XLA's kernel, refused.
  assert main(["generate", "--model", str(tiny_model), "--weights", "int8", "--prompt", "Hi",
               "--max-new-tokens", "12", "--no-chat", "--drafter", "self", "--tree",
               "dynamic:8"]) == 0
  assert capsys.readouterr().out == plain
  assert main(["generate", "--model", str(tiny_model), "--weights", "int8-xla", "--prompt", "Hi",
               "--max-new-tokens", "12", "--drafter", "self", "--tree", "dynamic:8"]) == 2
  assert "tree speculative decoding with an int8 target on XLA" in capsys.readouterr().err
  # bench refuses before any run, not after its autoregressive and chain runs.
  assert main(["bench", "--model", str(tiny_model), "--weights", "int8-xla", "--drafters", "self",
               "--tree", "chain:2", "--num-prompts", "1", "--no-transformers"]) == 2
  err = capsys.readouterr().err
  assert "tree speculative decoding with an int8 target on XLA" in err
  assert "autoregressive:" not in err
  assert main(["bench", "--model", str(tiny_model), "--weights", "int8-xla", "--drafters",
               "mtp:2", "--num-prompts", "1", "--no-transformers"]) == 2
  err = capsys.readouterr().err
  assert "int8 target on XLA's kernel" in err and "autoregressive:" not in err


def test_gamma_auto(tiny_model, capsys):
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "8",
               "--drafter", "self", "--gamma", "auto"]) == 0
  err = capsys.readouterr().err
  assert "--gamma auto" in err and "<- chosen" in err
  chosen = next(line for line in err.splitlines() if "<- chosen" in line).split()[0]
  assert f"gamma {chosen})" in err  # the run used the calibrated gamma
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--gamma", "auto",
               "--drafter", "ngram"]) == 2
  assert "--gamma auto picks a chain length for a model drafter" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--gamma", "four"])
  assert "expected an integer or 'auto'" in capsys.readouterr().err
  # bench-tau scores trees, not chains: a --gamma there would be silently ignored, so it is refused.
  with pytest.raises(SystemExit):
    main(["bench-tau", "--model", str(tiny_model), "--drafter", "self", "--tree", "fixed:2",
          "--gamma", "3"])
  assert "unrecognized arguments: --gamma" in capsys.readouterr().err


def test_generate_with_mask_token_probing(tiny_model, capsys):
  """--drafter mtp:K drafts chains of K without --gamma, trees at most K deep; more is refused
  in one line before anything compiles."""
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "6",
               "--drafter", "mtp:3"]) == 0
  assert "gamma 3)" in capsys.readouterr().err
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "6",
               "--drafter", "mtp", "--tree", "dynamic:6,1,1,6"]) == 0
  assert "tree dynamic:6,1,1,6)" in capsys.readouterr().err
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--drafter", "mtp",
               "--gamma", "3"]) == 2
  assert "need 3 masks per token; the probe has 2" in capsys.readouterr().err
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--drafter",
               "mtp:0"]) == 2
  assert "mtp:K takes K = 1 .. 8" in capsys.readouterr().err
  # NAME@P: adaptive draft length (a chain ends before a draft the probe is less than P sure of).
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "6",
               "--drafter", "mtp:3@0.2"]) == 0
  assert "with drafter mtp:3@0.2, gamma 3)" in capsys.readouterr().err
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--drafter",
               "mtp@1.5"]) == 2
  assert "probability in (0, 1]" in capsys.readouterr().err


def test_bench_runs_probing_and_stopping_drafters(tiny_model, tmp_path):
  """Their rounds do not split into "propose, then one forward": the bench's overhead baseline
  leaves them out instead of failing, and the runs stay identical to autoregressive decoding."""
  out = tmp_path / "bench.json"
  assert main(["bench", "--model", str(tiny_model), "--dataset", "humaneval", "--num-prompts", "1",
               "--max-new-tokens", "6", "--drafters", "mtp:2,ngram@1", "--no-transformers",
               "--json", str(out)]) == 0
  records = [r for r in json.loads(out.read_text()) if r["method"] == "jspec-speculative"]
  assert [r["drafter"] for r in records] == ["mtp:2", "ngram@1"]
  assert all(r["identical_to_ar"] for r in records)
  assert records[0]["gamma"] == 2


def test_bench_under_a_kv_budget(tiny_model, tmp_path, capsys):
  """--kv-budget puts every jspec run under the budget, autoregressive too, so each speculative
  record is measured against the same policy (and stays identical to it); the records carry both
  policies; transformers and the overhead baseline, which have no budget, are left out with a
  line saying so; a cadence that stops rounds at every eviction gets a note."""
  out = tmp_path / "bench.json"
  assert main(["bench", "--model", str(tiny_model), "--dataset", "humaneval", "--num-prompts", "1",
               "--max-new-tokens", "12", "--drafters", "mtp:2,self", "--gamma", "2",
               "--kv-budget", "24", "--kv-chunk", "8", "--kv-policy", "tova",
               "--kv-evict-every", "2", "--json", str(out)]) == 0
  err = capsys.readouterr().err
  assert "transformers (no such cache)" in err and "--kv-evict-every 3 lets whole rounds" in err
  records = json.loads(out.read_text())
  assert [r["method"] for r in records] == ["jspec-autoregressive"] + ["jspec-speculative"] * 2
  assert all(r["kv"]["method"] == "tova" and r["kv"]["budget"] == 24 for r in records)
  assert "draft_kv" not in records[0] and records[2]["draft_kv"]["method"] == "keydiff"
  assert all(r["identical_to_ar"] for r in records[1:])
  assert "engine_overhead" not in records[2]


def test_generate_with_layer_skipping(tmp_path, capsys):
  """--drafter skip:N calibrates on the target's own text, then drafts chains; trees and
  impossible N are refused in one line."""
  d, _, _ = ggufutil.tiny_hf_checkpoint(tmp_path, "llama", num_hidden_layers=4,
                                        max_position_embeddings=2048)
  ggufutil.make_tiny_tokenizer_dir(d, 256)
  assert main(["generate", "--model", str(d), "--prompt", "Hi", "--max-new-tokens", "6",
               "--drafter", "skip:2", "--gamma", "3"]) == 0
  assert "with drafter skip:2, gamma 3)" in capsys.readouterr().err
  assert main(["generate", "--model", str(d), "--prompt", "Hi", "--drafter", "skip:3"]) == 2
  assert "skips 1 .. 2 of the target's 4 layers" in capsys.readouterr().err
  assert main(["generate", "--model", str(d), "--prompt", "Hi", "--drafter", "skip:1",
               "--tree", "fixed:2"]) == 2
  assert "chains only" in capsys.readouterr().err


def test_bad_drafter(tiny_model, capsys):
  assert main(["generate", "--model", str(tiny_model), "--prompt", "x", "--drafter", "bogus"]) == 2
  assert "unknown drafter" in capsys.readouterr().err
  assert main(["generate", "--model", str(tiny_model), "--prompt", "x", "--drafter", "self",
               "--gamma", "0"]) == 2
  assert "gamma" in capsys.readouterr().err


def test_drafter_tokenizer_must_match(tiny_model, tmp_path):
  import copy

  from jspec.drafting.registry import load_drafter
  from jspec.io.load import check_same_tokenizer
  from jspec.model import load
  target = load(tiny_model)
  same = copy.deepcopy(target.tokenizer)
  check_same_tokenizer(target.tokenizer, same, "copy")  # identical: accepted
  same.tokens = list(same.tokens)
  same.tokens[70] = "something-else"
  with pytest.raises(ValueError, match="tokenizes differently.*id 70"):
    check_same_tokenizer(target.tokenizer, same, "edited")
  other = ggufutil.tiny_hf_checkpoint(tmp_path, "llama", vocab_size=320)[0]
  ggufutil.make_tiny_tokenizer_dir(other, 320)
  with pytest.raises(ValueError, match="vocabulary of 320 tokens"):
    load_drafter(f"model:{other}", target)
  drafter = load_drafter(f"model:{tiny_model}", target)
  assert drafter.vocab_size == target.cfg.vocab_size


def test_ngram_drafter_names(tiny_model):
  from jspec.drafting.registry import load_drafter
  from jspec.model import load
  from jspec.drafting.model import ModelDrafter
  target = load(tiny_model)
  alone = load_drafter("ngram", target)
  assert (alone.n_min, alone.n_max, alone.fallback) == (1, 4, None)
  assert alone.vocab_size == target.cfg.vocab_size
  hybrid = load_drafter(f"ngram:3-5+model:{tiny_model}", target)
  assert (hybrid.n_min, hybrid.n_max) == (3, 5) and isinstance(hybrid.fallback, ModelDrafter)
  assert load_drafter("ngram+self", target).n_min == 2
  for bad, match in (("ngram:3", "ngram:N1-N2"), ("ngram:a-b", "ngram:N1-N2"),
                     ("ngram:4-2", "N1 <= N2"), ("ngram+", "after '\\+'"),
                     ("ngram+ngram", "after '\\+'"), ("ngram+bogus", "unknown drafter")):
    with pytest.raises(ValueError, match=match):
      load_drafter(bad, target)


def test_bench_several_drafters_with_transformers_assisted(tiny_model, tmp_path,
                                                           transformers_on_cpu):
  out = tmp_path / "multi.json"
  assert main(["bench", "--model", str(tiny_model), "--dataset", "mt-bench", "--num-prompts", "2",
               "--max-new-tokens", "8", "--drafters", f"self,model:{tiny_model}", "--gamma", "3",
               "--no-ttft", "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  methods = [(r["method"], r["drafter"]) for r in records]
  assert methods == [("jspec-autoregressive", "none"), ("jspec-speculative", "self"),
                     ("jspec-speculative", f"model:{tiny_model}"), ("transformers-generate", "none"),
                     ("transformers-assisted", "self"),
                     ("transformers-assisted", f"model:{tiny_model}")]
  for spec, assisted in zip(records[1:3], records[4:6]):
    assert assisted["identical_to_jspec"] == 1.0  # greedy assisted generation is lossless too
    assert assisted["target_calls"] is None and spec["target_calls"] > 0  # none reported
    assert spec["speedup_vs_transformers_assisted"] == pytest.approx(
        spec["tokens_per_s"] / assisted["tokens_per_s"])


def test_bench_tree_records(tiny_model, tmp_path):
  """Trees beside their chain; with --no-ttft (a sweep's setting) one program per bucket for
  speculative runs and no overhead baseline; chain:D runs the chain through the tree engine at the
  same node budget as a tree."""
  out = tmp_path / "tree.json"
  assert main(["bench", "--model", str(tiny_model), "--dataset", "mt-bench", "--num-prompts", "1",
               "--max-new-tokens", "9", "--drafters", "self", "--gamma", "2", "--no-ttft",
               "--tree", "rsd-s:2,2,chain:2", "--no-transformers", "--json", str(out)]) == 0
  ar, spec, tree, chain = json.loads(out.read_text())
  assert [r["method"] for r in (ar, spec, tree, chain)] == [
      "jspec-autoregressive", "jspec-speculative", "jspec-tree", "jspec-tree"]
  assert (tree["drafter"], tree["tree"], tree["tree_nodes"]) == ("self", "rsd-s:2,2", 5)
  assert tree["identical_to_ar"] == 1.0 and tree["tokens_per_s"] > 0
  assert tree["accepted_per_round"] == 3.0  # the self drafter: every path accepted to depth 2
  assert tree["target_calls"] < ar["target_calls"]
  for key in ("block_efficiency", "speedup_vs_ar", "speedup_vs_chain", "accept_hist"):
    assert key in tree
  # Ratios from side-by-side timings: the tree beside its chain, the chain beside AR.
  assert tree["speedup_vs_chain"] == pytest.approx(tree["tokens_per_s"] / tree["chain_tokens_per_s"])
  assert tree["speedup_vs_ar"] == pytest.approx(tree["speedup_vs_chain"] * spec["speedup_vs_ar"])
  assert tree["speedup_vs_ar_direct"] == pytest.approx(tree["tokens_per_s"] / ar["tokens_per_s"])
  # --no-ttft: the autoregressive baseline still times its first token, nothing else does.
  assert ar["ttft_s"] > 0 and ar["programs"] == 2 * spec["programs"]
  for r in (spec, chain, tree):
    assert r["ttft_s"] is None and r["decode_s"] is None and r["round_s"] > 0
  assert "round_components_s" not in spec and "engine_overhead" not in spec
  assert (chain["tree"], chain["tree_method"], chain["tree_nodes"]) == ("chain:2", "chain", 3)
  assert chain["identical_to_ar"] == 1.0 and chain["accepted_per_round"] == 3.0
  assert chain["target_calls"] == spec["target_calls"]  # the same chain, the same rounds


def test_bench_bad_tree(tiny_model, capsys):
  assert main(["bench", "--model", str(tiny_model), "--tree", "rsd-s:2,2"]) == 2
  assert "--tree set(s) how a drafter drafts, but no drafter" in capsys.readouterr().err
  assert main(["bench", "--model", str(tiny_model), "--drafters", "self", "--tree", "rsd-s:2"]) == 2
  assert "W,D" in capsys.readouterr().err


def test_bench_tau_paired_records(tiny_model, tmp_path, capsys):
  """bench-tau: the self drafter's every round accepts the whole depth, for every tree, at T=1
  too (q = p), so every context scores tau = D + 1 and equal-budget pairs differ by exactly 0."""
  out = tmp_path / "tau.json"
  assert main(["bench-tau", "--model", str(tiny_model), "--dataset", "mt-bench", "--num-prompts",
               "2", "--max-new-tokens", "6", "--stride", "3", "--rounds", "2", "--batch", "2",
               "--temperature", "1", "--drafter", "self", "--tree", "rsd-c:2-1,specinfer:2-1",
               "--tree", "chain:2", "--json", str(out)]) == 0
  records = json.loads(out.read_text())
  taus = [r for r in records if r["kind"] == "paired_tau"]
  assert [r["tree"] for r in taus] == ["rsd-c:2-1", "specinfer:2-1", "chain:2"]
  for r in taus:
    assert r["tau"] == 3.0 and r["contexts"] >= 2 and r["rounds_per_context"] == 2
    assert r["responses"] == 2  # errors clustered by the response a context was cut from
    assert r["dataset"] == "mt-bench" and r["temperature"] == 1.0 and "command" in r
    # What else changes tau: the weights, the responses' length, the contexts' keys (per batch).
    assert (r["weights"], r["drafter_weights"], r["max_new_tokens"], r["batch"]) == (
        "float32", "float32", 6, 2)
  (diff,) = [r for r in records if r["kind"] == "paired_difference"]
  assert (diff["tree_a"], diff["tree_b"], diff["tau_a_minus_b"]) == ("rsd-c:2-1", "specinfer:2-1", 0)
  assert "rsd-c:2-1 - specinfer:2-1: +0.000" in capsys.readouterr().out
  assert main(["bench-tau", "--model", str(tiny_model), "--drafter", "none", "--tree",
               "chain:2"]) == 2
  assert "needs a drafter" in capsys.readouterr().err
  # Flags the drafter would not read are refused, as in bench and generate.
  for extra in (["--drafter-weights", "int8"], ["--kv-budget", "64", "--kv-drafter", "keydiff"]):
    assert main(["bench-tau", "--model", str(tiny_model), "--drafter", "ngram", "--tree",
                 "chain:2", *extra]) == 2
    assert "does not read it" in capsys.readouterr().err


def test_bench_tau_under_a_kv_budget(tiny_model, tmp_path, capsys):
  """bench-tau --kv-budget scores rounds as the budgeted engine runs them: every chat prompt
  overfills a budget of 8, so at --kv-evict-every 1 each round is cut before its first draft
  (tau exactly 1, while the same trees on the full cache accept the self drafter's whole depth);
  the records carry both policies, and the cadence note is printed."""
  out = tmp_path / "tau.json"
  base = ["bench-tau", "--model", str(tiny_model), "--num-prompts", "2", "--max-new-tokens", "4",
          "--stride", "2", "--rounds", "1", "--batch", "2", "--drafter", "self", "--tree",
          "chain:2,rsd-c:2-1", "--json", str(out)]
  assert main(base + ["--kv-budget", "8", "--kv-policy", "h2o", "--kv-evict-every", "1"]) == 0
  records = json.loads(out.read_text())
  taus = [r for r in records if r["kind"] == "paired_tau"]
  assert [r["tau"] for r in taus] == [1.0, 1.0]
  assert all(r["kv"]["budget"] == 8 and r["kv"]["method"] == "h2o" for r in records)
  assert all(r["draft_kv"]["method"] == "keydiff" for r in records)  # --kv-drafter auto
  assert "--kv-evict-every 3" in capsys.readouterr().err
  assert main(base) == 0
  assert [r["tau"] for r in json.loads(out.read_text()) if r["kind"] == "paired_tau"] == [3.0, 3.0]
  assert all(r["kv"] is None for r in json.loads(out.read_text()))
  # A drafter with no cache of its own: no draft_kv (one tree is enough to tell).
  lookup = [{"self": "ngram", "chain:2,rsd-c:2-1": "chain:2"}.get(a, a) for a in base]
  assert main(lookup + ["--kv-budget", "8"]) == 0
  assert all(r["kv"]["budget"] == 8 and r["draft_kv"] is None
             for r in json.loads(out.read_text()))


def test_generate_with_a_tree_prints_the_autoregressive_text(tiny_model, capsys):
  base = ["generate", "--model", str(tiny_model), "--prompt", "Why is the sky blue?",
          "--max-new-tokens", "8"]
  assert main(base) == 0
  want = capsys.readouterr().out
  assert main(base + ["--drafter", "ngram+self", "--tree", "dynamic:6"]) == 0
  captured = capsys.readouterr()
  assert captured.out == want and "tree dynamic:6" in captured.err
  assert main(base + ["--tree", "dynamic:6"]) == 2
  assert "--tree set(s) how a drafter drafts, but no drafter" in capsys.readouterr().err
  assert main(base + ["--drafter", "self", "--tree", "bushy:3"]) == 2
  assert "unknown tree method" in capsys.readouterr().err
  assert main(base + ["--drafter", "self@0.5", "--tree", "fixed:2"]) == 2  # the stop: chains only
  assert "stops chains only" in capsys.readouterr().err


def test_a_second_run_compiles_nothing(tiny_model, tmp_path):
  """The CLI keeps JAX's persistent compilation cache: the same command run again builds no XLA
  program (it loads them), and prints the same text."""
  import os
  import re
  import subprocess
  import sys

  env = dict(os.environ, JSPEC_COMPILATION_CACHE=str(tmp_path / "xla"))
  cmd = [sys.executable, "-m", "jspec.cli", "generate", "--model", str(tiny_model), "--prompt",
         "Hi", "--max-new-tokens", "4", "--drafter", "self", "--gamma", "2"]
  runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
          for _ in range(2)]
  built = []
  for run in runs:
    assert run.returncode == 0, run.stderr
    built.append(int(re.search(r"\((\d+) XLA programs built", run.stderr).group(1)))
  assert built[0] > 0 and built[1] == 0, built
  assert runs[0].stdout == runs[1].stdout
  assert any((tmp_path / "xla").iterdir())


def test_precision_flag_covers_the_whole_command(tiny_model, monkeypatch):
  import jax
  import jspec.cli.generate
  seen = []
  monkeypatch.setattr(jspec.cli.generate, "cmd_generate",
                      lambda args: seen.append(jax.config.jax_default_matmul_precision) or 0)
  for flag, want in (("exact", "highest"), ("fast", None)):
    with jax.default_matmul_precision(None):  # no global setting (conftest: accelerators)
      assert main(["generate", "--model", str(tiny_model), "--prompt", "x",
                   "--precision", flag]) == 0
    assert seen.pop() == want
  with pytest.raises(SystemExit):
    main(["generate", "--model", str(tiny_model), "--prompt", "x", "--precision", "tf32"])


def test_transformers_static_cache_run(tiny_model):
  """The static-cache baseline (run on CUDA by `jspec bench`): one cache size for all prompts, the
  same greedy tokens as the default cache."""
  from jspec.bench import speed
  from jspec.model import load
  from jspec.sampling.processing import GREEDY
  model = load(tiny_model)
  hf = speed._load_transformers(model.source)
  prompts = [[1, 5, 9], [2, 6, 10, 14, 18, 22]]
  dynamic, _ = speed.bench_transformers(hf, model, prompts, 5, GREEDY, 0)
  static, extra = speed.bench_transformers(hf, model, prompts, 5, GREEDY, 0, cache="static")
  assert extra["cache"] == "static" and extra["torch_device"] == "cpu"
  assert static.outputs == dynamic.outputs and static.new_tokens == dynamic.new_tokens


def test_mesh_settings_are_checked_before_loading(tiny_model, capsys):
  """--mesh text, its size against the visible devices, the batch over dp and the weight formats
  that cannot shard: each a one-line error (the runs themselves: tests/test_sharding.py)."""
  n = len(jax.devices())
  cases = [(["generate", "--prompt", "Hi", "--mesh", "dp=2,pp=2"], "expected axes dp and/or tp"),
           (["generate", "--prompt", "Hi", "--mesh", f"tp={n + 1}"],
            f"needs {n + 1} devices, but {n} are visible"),
           (["generate", "--prompt", "Hi", "--mesh", "tp=1", "--weights", "int8"],
            "not placed on a mesh"),
           (["bench-tau", "--drafter", "self", "--tree", "fixed:2", "--mesh", "tp=1"],
            "bench-tau scores trees on one device")]
  for argv, message in cases:
    assert main(argv + ["--model", str(tiny_model)]) == 2, argv
    assert message in capsys.readouterr().err, argv
  # A one-device mesh runs (XLA's float32 dot) and says where it ran.
  assert main(["generate", "--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "4",
               "--mesh", "dp=1,tp=1"]) == 0
  assert "on {'dp': 1, 'tp': 1} cpu devices" in capsys.readouterr().err


def test_version_and_defaults_in_help(capsys):
  with pytest.raises(SystemExit) as done:
    main(["--version"])
  assert done.value.code == 0
  assert capsys.readouterr().out.startswith("jspec ")
  with pytest.raises(SystemExit):
    main(["train-eagle", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "(default: 7)" in text and "(default: eagle)" in text  # --ttt-steps, --network
  assert "(default: None)" not in text
  # zeros are defaults too, and options without a help text show theirs
  with pytest.raises(SystemExit):
    main(["generate", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "0 = greedy (default: 0.0)" in text and "--seed SEED default: 0" in text
  assert "--max-new-tokens MAX_NEW_TOKENS default: 128" in text


def test_train_eagle_refuses_flags_of_the_other_network(capsys, tmp_path):
  assert main(["train-eagle", "--out", "/nonexistent", "--data", str(tmp_path),
               "--network", "eagle3", "--unroll", "1"]) == 2
  assert "--unroll" in capsys.readouterr().err
  assert main(["train-eagle", "--out", "/nonexistent", "--data", str(tmp_path),
               "--network", "eagle3", "--anchors", "8"]) == 2
  assert "--anchors" in capsys.readouterr().err
  assert main(["train-eagle", "--out", "/nonexistent", "--data", str(tmp_path),
               "--network", "confu", "--noise", "0.1"]) == 2
  assert "--noise" in capsys.readouterr().err
  # a network's own default, given explicitly to another network, is refused too
  assert main(["train-eagle", "--out", "/nonexistent", "--data", str(tmp_path),
               "--network", "eagle", "--ttt-steps", "7"]) == 2
  assert "--ttt-steps" in capsys.readouterr().err


def test_train_eagle_help_names_the_networks_defaults(capsys):
  """The network flags are unset unless given (so another network's flags are told apart from
  defaults); their help names the dataclass default that then applies."""
  from jspec.cli.options import NETWORK_FLAGS
  from jspec.train.confu import ConFuLoss, ConFuRecipe
  from jspec.train.eagle import EagleLoss
  from jspec.train.eagle3 import Eagle3Loss
  owner = {"cls_weight": EagleLoss, "unroll": EagleLoss, "noise": EagleLoss,
           "ttt_steps": Eagle3Loss, "ttt_decay": Eagle3Loss, "anchors": ConFuLoss,
           "experts": ConFuRecipe, "expert_top_k": ConFuRecipe, "soft_tokens": ConFuRecipe}
  assert set(owner) == set(NETWORK_FLAGS)
  with pytest.raises(SystemExit):
    main(["train-eagle", "--help"])
  text = " ".join(capsys.readouterr().out.split()).split("options:", 1)[1]  # past the usage
  for name, cls in owner.items():
    flag = "--" + name.replace("_", "-")
    shown = text.split(flag + " ", 1)[1].split(" --", 1)[0]
    default = getattr(cls, NETWORK_FLAGS[name][1])
    assert f"(default: {default})" in shown, (flag, shown, default)
  from jspec.train.trainer import TrainConfig
  assert f"(default: {TrainConfig.warmup_steps}, at most --steps)" in text  # --warmup-steps


@pytest.mark.parametrize("argv,message", [
    (["generate", "--drafter", "model:/nonexistent"], "drafter 'model:/nonexistent': no drafter at"),
    (["generate", "--drafter", "ngram:3"], "ngram:N1-N2"),
    (["generate", "--drafter", "early-exit:x"], "drafter 'early-exit:x': write early-exit:K"),
    (["generate", "--drafter", "default@1.5"], "drafter 'default@1.5': @P takes a probability"),
    (["generate", "--drafter", "bogus+ngram"], "unknown drafter"),
    (["generate", "--prompt", "  "], "--prompt is empty"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "--model", "/nonexistent.gguf"], "model '/nonexistent.gguf' not found"),
    (["generate", "--drafter", "ngram", "--tree", "bogus:3"], "unknown tree method"),
    (["generate", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--repetition-penalty", "0", "--prompt", "a"], "--repetition-penalty must be"),
    (["generate", "--temperature", "0.5,-1", "--prompt", "a", "--prompt", "b"],
     "--temperature[1] must be"),
    (["generate", "--kv-budget", "0"], "--kv-budget must be at least 1, got 0"),
    (["generate", "--kv-budget", "64", "--kv-chunk", "128"],
     "--kv-chunk 128 is larger than --kv-budget 64"),
    (["bench", "--drafters", "ngram,mtp:9"], "mtp:K takes K = 1 .. 8"),
    (["bench", "--drafters", "lookahead:5-4"], "write lookahead:W-N-G (window, n-gram size, guess set), e.g. lookahead:5-4-5; got 'lookahead:5-4'"),
    (["bench-tau", "--tree", "fixed:2", "--rounds", "0"], "--rounds must be at least 1"),
    (["distill-data", "--out", "o", "--top-k", "0"], "--top-k must be at least 1 for distillation"),
    (["bench-kv", "--budgets", "64,0"], "--budgets: each must be at least 1, got 0"),
    (["bench-kv", "--budgets", "abc"], "--budgets: expected comma-separated integers, got 'abc'"),
    (["bench-kernel", "--kernel", "key-similarity", "--block-s", "0"], "--block-s must be at least"),
    # settings nothing would read are refused, not ignored (a run would report them as measured)
    (["generate", "--kv-policy", "h2o", "--kv-chunk", "7"],
     "--kv-policy, --kv-chunk set(s) how a KV budget evicts, but no --kv-budget"),
    (["generate", "--kv-evict-every", "4"], "no --kv-budget is given"),
    (["generate", "--kv-budget", "32", "--kv-drafter", "streaming"],
     "--kv-drafter set(s) how a drafter drafts, but no drafter is given"),
    (["generate", "--gamma", "3"], "--gamma set(s) how a drafter drafts, but no drafter"),
    (["generate", "--drafter-weights", "q4"], "--drafter-weights set(s) how a drafter drafts"),
    (["generate", "--tree", "chain:4"], "--tree set(s) how a drafter drafts"),
    (["bench", "--gamma", "3"], "--gamma set(s) how a drafter drafts"),
    (["generate", "--drafter", "ngram", "--gamma", "3", "--tree", "chain:2"],
     "--gamma sets a chain's length and --tree chain:2 a tree's shape"),
    (["generate", "--drafter", "ngram", "--gamma", "50", "--max-new-tokens", "8"],
     "--gamma 50 drafts more tokens a round than --max-new-tokens 8"),
    (["generate", "--drafter", "ngram", "--tree", "chain:0"], "tree 'chain:0': chain takes one"),
    (["bench-tau", "--tree", "fixed:2", "--drafter", "none"], "bench-tau needs a drafter"),
    (["bench-tau", "--tree", "chain:2,fixed:2,chain:2"], "--tree names chain:2 more than once"),
    (["bench", "--drafters", "ngram,self,ngram"], "--drafters names ngram more than once"),
    (["bench-kv", "--budgets", "32,64,32"], "--budgets names 32 more than once"),
    (["bench-kernel", "--block-s", "32"], "--block-s set(s) the other kernel's blocks"),
    (["bench-kernel", "--kernel", "key-similarity", "--block-k", "32"],
     "--block-k set(s) the other kernel's blocks"),
    (["train-drafter", "--out", "o", "--lr", "nan"], "--lr must be a finite number > 0"),
    (["train-drafter", "--out", "o", "--lr", "-0.1"], "--lr must be a finite number > 0"),
    (["train-drafter", "--out", "o", "--warmup-steps", "-5"], "--warmup-steps must be at least 0"),
    (["train-drafter", "--out", "o", "--steps", "20", "--warmup-steps", "30"],
     "--warmup-steps 30 is more than --steps 20"),
    (["train-drafter", "--out", "o", "--hidden-size", "-64"], "--hidden-size must be at least 1"),
    (["distill-data", "--out", "o", "--prompt-offset", "-3"], "--prompt-offset must be at least 0"),
    (["train-eagle", "--out", "o", "--data", ".", "--network", "confu", "--experts", "2",
      "--expert-top-k", "3"], "--expert-top-k 3 picks more experts than --experts 2"),
    (["train-eagle", "--out", "o", "--data", ".", "--network", "eagle3", "--ttt-decay", "1.5"],
     "--ttt-decay must be in (0, 1]"),
    (["eval-drafter", "--drafters", "self,ngram", "--data", "."],
     "--drafters 'ngram': eval-drafter scores draft models"),
    (["eval-drafter", "--drafters", "self,model:/nope", "--data", "."], "drafter 'model:/nope'"),
    (["train-eagle", "--target", "default", "--out", "o", "--data", "/nonexistent:2"],
     "--data /nonexistent:2: no directory '/nonexistent'"),
    (["trim-vocab", "--drafter", "/nope", "--size", "4", "--out", "o"], "--drafter: model '/nope'"),
    # decided by the flags alone (each was refused only after the model had loaded, or not at all)
    (["generate", "--drafter", "skip:4", "--tree", "fixed:2"], "layer-skip drafts (--drafter"),
    (["generate", "--drafter", "ngram", "--gamma", "auto"], "--gamma auto picks a chain length"),
    (["score", "--text", "hi", "--chunk", "0"], "--chunk must be at least 1, got 0"),
    (["generate", "--drafter", "ngram", "--drafter-weights", "int8"],
     "--drafter-weights sets the draft model's weights (default, model:PATH; `self` drafts with "
     "the target's own); --drafter ngram does not read it"),
    (["bench", "--drafters", "ngram,mtp:3", "--drafter-weights", "int8"],
     "--drafter ngram,mtp:3 does not read it"),
    (["generate", "--drafter", "ngram", "--kv-budget", "64", "--kv-drafter", "full"],
     "--kv-drafter sets a draft model's own cache"),
    (["generate", "--drafter", "self", "--drafter-weights", "q4"], "--drafter self does not read"),
    (["bench", "--json", "/proc/nope/x.json"], "--json /proc/nope/x.json: nothing can be written"),
    (["distill-data", "--out", "/proc/nope/o"], "--out /proc/nope/o: nothing can be written"),
    (["generate", "--drafter", "lookahead:4-3-4", "--gamma", "3"],
     "--drafter lookahead:4-3-4 verifies a tree of its own each round"),
    (["generate", "--draft-penalties", "--repetition-penalty", "1.2"],
     "--draft-penalties sets how a drafter drafts, but no drafter is given"),
    (["generate", "--drafter", "default", "--no-draft-penalties"],
     "the run has none, so it would change nothing"),
    (["bench", "--drafters", "ngram,lookahead", "--draft-penalties", "--presence-penalty", "0.5"],
     "--draft-penalties: --drafter ngram,lookahead drafts from a lookup"),
    (["bench-tau", "--drafter", "rest", "--tree", "fixed:2", "--draft-penalties",
      "--repetition-penalty", "1.1"], "--drafter rest drafts from a lookup"),
])
def test_arguments_are_checked_before_anything_loads(monkeypatch, capsys, argv, message):
  """Every argument a command can check without a model fails first, in one line naming the flag
  (or the drafter), with no model loaded and nothing fetched (both patched to fail loudly)."""
  import importlib
  import jspec.model

  def refuse(*args, **kwargs):
    raise AssertionError("a model was loaded or fetched before the arguments were checked")
  monkeypatch.setattr(jspec.model, "load", refuse)
  # Every module that binds fetch at import, imported before the patch and patched: one first
  # imported under the patch kept `refuse` for the tests after this one.
  for name in ("jspec.io.fetch", "jspec.io.load", "jspec.data", "jspec.train.prompts"):
    monkeypatch.setattr(importlib.import_module(name), "fetch", refuse)
  if argv[0] == "generate" and "--prompt" not in argv:
    argv = argv + ["--prompt", "hello"]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [
    "generate --prompt hi --drafter ngram+default --drafter-weights int8",  # the fallback reads it
    "generate --prompt hi --drafter self --kv-budget 64 --kv-drafter full",
    "generate --prompt hi --drafter early-exit:10 --kv-budget 64 --kv-drafter keydiff",
    "generate --prompt hi --drafter default --gamma auto",
    "generate --prompt hi --drafter skip:4 --gamma 3",
    "bench --drafters ngram,default --drafter-weights int8 --json {tmp}/new/dir/r.json",
    "score --text hi --chunk 4",
    "generate --prompt hi --drafter ngram+default --no-draft-penalties --frequency-penalty 0.1",
    "bench --drafters ngram,mtp:2 --draft-penalties --repetition-penalty 1.1",  # mtp reads it
    "bench --drafters lookahead,ngram --gamma 3",  # the chain of ngram reads it
    "generate --prompt a --prompt b --drafter self --draft-penalties --presence-penalty 0,0.5",
])
def test_flags_a_drafter_reads_pass_the_checks(tmp_path, argv):
  """The refusals above stop where a flag would be read: these pass check_args (and create no
  directory: a writable path is tested with a file made and removed where the path starts)."""
  from jspec.cli import build_parser
  from jspec.cli.checks import check_args
  check_args(build_parser().parse_args(argv.format(tmp=tmp_path).split()))
  assert list(tmp_path.iterdir()) == []


def test_target_has_one_name_across_subcommands():
  """--model everywhere, --target its alias (the training commands used to take only --target)."""
  from jspec.cli import build_parser
  parser = build_parser()
  for argv in (["generate", "--prompt", "x"], ["bench"], ["bench-kv"], ["distill-data", "--out", "o"],
               ["train-drafter", "--out", "o"], ["trim-vocab", "--drafter", "d", "--size", "2",
                                                  "--out", "o"],
               ["eval-drafter", "--drafters", "self", "--data", "d"],
               ["train-eagle", "--out", "o", "--data", "d"]):
    for flag in ("--model", "--target"):
      assert parser.parse_args(argv + [flag, "m.gguf"]).model == "m.gguf", (argv, flag)


def test_scan_layers(tiny_model, capsys, tmp_path):
  """--scan-layers: the same greedy text (stacked layers round like unrolled ones here), a model
  drafter stacked with the target, bench records saying so; q4 (a CPU kernel) stacked gives its
  unrolled text."""
  common = ["generate", "--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "12",
            "--no-chat"]
  assert main(common + ["--weights", "float32-xla"]) == 0
  plain = capsys.readouterr().out
  assert main(common + ["--scan-layers"]) == 0
  assert capsys.readouterr().out == plain
  assert main(common + ["--scan-layers", "--drafter", f"model:{tiny_model}"]) == 0
  assert capsys.readouterr().out == plain
  assert main(common + ["--scan-layers", "--weights", "q4"]) == 0  # a CPU kernel, stacked
  q4 = capsys.readouterr().out
  assert main(common + ["--no-scan-layers", "--weights", "q4"]) == 0
  assert capsys.readouterr().out == q4
  out = tmp_path / "scan.json"
  assert main(["bench", "--model", str(tiny_model), "--scan-layers", "--num-prompts", "1",
               "--max-new-tokens", "4", "--no-transformers", "--json", str(out)]) == 0
  assert json.loads(out.read_text())[0]["layers"] == "stacked"


def test_layers_stack_by_default_where_jspecs_cpu_kernels_run(tiny_model):
  """`load()` stacks weights on jspec's CPU kernels (3-7x faster compiles, the same decode speed
  there) and leaves XLA's formats unrolled (stacked, XLA's dots slice every layer each step);
  scan_layers=True/False decides."""
  from jspec.model import load, stacks_by_default
  from jspec.models.llama import layers_stacked
  on_cpu = jax.default_backend() == "cpu"
  assert stacks_by_default("q4", None) == on_cpu
  for fmt in ("float32", "int8", "float32-xla", "bfloat16"):
    want = on_cpu and fmt in ("float32", "int8")
    assert stacks_by_default(fmt, None) == want, fmt
    assert layers_stacked(load(tiny_model, fmt).params) == want, fmt
    assert not layers_stacked(load(tiny_model, fmt, scan_layers=False).params)
    assert layers_stacked(load(tiny_model, fmt, scan_layers=True).params)
  assert not stacks_by_default("float32", "dp=1,tp=1")  # a mesh: XLA's formats


def test_filters_at_temperature_zero_are_noted(capsys):
  from jspec.cli import build_parser, check_args
  check_args(build_parser().parse_args(["generate", "--prompt", "x", "--top-k", "5"]))
  assert "at --temperature 0 (greedy, the default) they change nothing" in capsys.readouterr().err
  check_args(build_parser().parse_args(["generate", "--prompt", "x", "--top-k", "5",
                                        "--temperature", "0.7"]))
  assert capsys.readouterr().err == ""


def test_data_and_output_paths_are_checked_before_anything_loads(monkeypatch, capsys, tmp_path):
  """--data must be distillation data with the shards asked for, each directory once, and not
  beside flags that only generating data reads; --out and --json must be writable as what the
  command writes (a directory, a file)."""
  import jspec.model

  def refuse(*args, **kwargs):
    raise AssertionError("a model was loaded before the arguments were checked")
  monkeypatch.setattr(jspec.model, "load", refuse)
  data = tmp_path / "data"
  data.mkdir()
  (data / "manifest.json").write_text(json.dumps({"num_shards": 2}))
  afile = tmp_path / "afile"
  afile.write_text("")
  out = str(tmp_path / "out")
  for argv, message in [
      (["train-drafter", "--out", out, "--data", str(tmp_path)], "no manifest.json"),
      (["train-drafter", "--out", out, "--data", f"{data}:5-2"], "the range [5, 2) is not inside"),
      (["train-drafter", "--out", out, "--data", f"{data}:3"], "the range [0, 3) is not inside"),
      (["train-drafter", "--out", out, "--data", str(data), "--data", f"{data}:1"],
       "is given twice"),
      (["train-drafter", "--out", out, "--data", str(data), "--top-k", "4"],
       "--top-k set(s) how distillation data is generated, but --data gives the data"),
      (["train-drafter", "--out", str(afile), "--data", str(data)], "is a file; this command"),
      (["build-datastore", "--out", str(tmp_path)], "is a directory; this command writes a file"),
      (["bench-kv", "--json", str(tmp_path)], "is a directory. Fix: a file path"),
  ]:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, (argv, err)


def test_score_takes_no_drafter_flag():
  """score listed --kv-drafter in its --help and refused it whenever it was given."""
  from jspec.cli.parser import build_parser
  with pytest.raises(SystemExit):
    build_parser().parse_args(["score", "--text", "x", "--kv-budget", "8", "--kv-drafter", "full"])
  assert "--kv-drafter" not in build_parser()._subparsers._group_actions[0].choices[
      "score"].format_help()
