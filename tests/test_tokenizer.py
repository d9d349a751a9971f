"""Tokenizer parity: jspec's tokenizers vs transformers, SentencePiece and llama.cpp's rules."""

import io
import json

import gguf
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jspec.io.fetch import default_model_path
from jspec.io.gguf_file import GGUFFile
from jspec.io.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Hello, world! How are you today?",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "Pi is 3.14159; 2024 had 366 days and 1,000,000 seconds is ~11.57 days.",
    "héllo wörld — naïve café, 日本語, 한국어 and emoji 🤖🎉👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "   three leading spaces, two trailing  ",
    "line one\n\n\nline two\r\nline three\n",
    "I'm sure they'll've done it; DON'T PANIC.",
    "a<|im_end|>b <|endoftext|> c<repo_name>d",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about JAX."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
]
CHATML = ("{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# --- The default model (SmolLM2-135M-Instruct GGUF: byte-level BPE, pre "smollm") -----------------

@pytest.fixture(scope="module")
def smollm():
  path = default_model_path(progress=False)
  ours = Tokenizer.from_gguf(GGUFFile(path))
  ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  return ours, ref


@pytest.mark.slow
def test_fingerprint_is_the_vocabulary_whatever_the_file(smollm, hf_dir, tmp_path):
  """The same vocabulary read from a GGUF file and from tokenizer.json has one fingerprint
  (distillation data records it); another vocabulary has another."""
  ours, ref = smollm
  ref.save_pretrained(tmp_path)
  assert Tokenizer.from_hf_dir(tmp_path).fingerprint == ours.fingerprint
  assert Tokenizer.from_hf_dir(hf_dir).fingerprint != ours.fingerprint


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_ids_and_decode_match_transformers(smollm, text):
  ours, ref = smollm
  ids = ours.encode(text)
  assert ids == ref.encode(text, add_special_tokens=True)
  assert ours.decode(ids, skip_special_tokens=False) == text
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_gguf_numerals_split_like_llama_cpp(smollm):
  # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json: Digits, then ByteLevel) cuts
  # every numeral off first; transformers' GGUF converter skips that, which shows only on a space
  # before a non-ASCII numeral (the vocabulary has no multi-digit merges).
  ours, ref = smollm
  original = tokenizers.Tokenizer.from_str(ours.backend.to_str())
  original.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  for text in [*SAMPLES, "x² + ½ = 2.5", " ½ cup"]:
    assert ours.encode(text) == original.encode(text, add_special_tokens=False).ids, text
  assert [ours.tokens[i] for i in ours.encode(" ½")] == ["Ġ", "Â½"]
  assert ref.convert_ids_to_tokens(ref.encode(" ½")) == ["ĠÂ", "½"]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user"])
def test_gguf_chat_template_matches_transformers(smollm, messages):
  ours, ref = smollm
  prompt = ours.apply_chat_template(messages)
  assert prompt == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert prompt.endswith("<|im_start|>assistant\n")
  ids = ours.encode(prompt, add_special_tokens=False)
  assert ids == ref.encode(prompt, add_special_tokens=False)
  closed = ours.apply_chat_template(messages, add_generation_prompt=False)
  assert closed == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


@pytest.mark.slow
def test_gguf_special_ids_and_vocab(smollm):
  ours, ref = smollm
  im_end = ref.convert_tokens_to_ids("<|im_end|>")
  assert "<|im_end|>" in ours.chat_template  # The template closes every turn with it.
  assert im_end in ours.stop_token_ids
  assert ours.eos_token_id == ref.eos_token_id and ours.eos_token_id in ours.stop_token_ids
  assert ours.bos_token_id == ref.bos_token_id
  assert ours.add_bos is False  # The file says so: encode adds nothing.
  assert ours.vocab_size == len(ref) == 49152
  assert ours.tokens == ref.convert_ids_to_tokens(list(range(ours.vocab_size)))


# --- A tiny Hugging Face directory ---------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf_tokenizer")
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator(
      ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
       "Speculative decoding drafts tokens and the target model verifies them."] * 8, trainer)
  backend.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                         special_tokens=[("<s>", 0)])
  backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHATML}))
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
  return path


@pytest.mark.parametrize("text", ["The quick brown fox", "def add(a, b):\n    return a + b",
                                  "<|im_start|>user\nhi<|im_end|>", "ünïcode 🦊 text"])
def test_hf_dir_matches_transformers(hf_dir, text):
  ours = Tokenizer.from_hf_dir(hf_dir)
  ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  ids = ours.encode(text)
  assert ids == ref.encode(text) and ids[0] == ours.bos_token_id == 0
  assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
  assert ours.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_hf_dir_chat_template_and_stops(hf_dir):
  ours = Tokenizer.from_hf_dir(hf_dir)
  ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  for messages in CONVERSATIONS:
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
  # </s>; <|endoftext|> from generation_config's list; <|im_end|>, which ends the template's turns.
  assert ours.eos_token_id == 1 and ours.stop_token_ids == (1, 4, 3)
  assert ours.vocab_size == len(ref) == 320


def test_hf_dir_bos_follows_config_then_post_processor(hf_dir, tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
  assert Tokenizer.from_hf_dir(tmp_path).encode("fox")[0] != 0
  del config["add_bos_token"]  # No flag: the post-processor, which adds <s>, decides.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert Tokenizer.from_hf_dir(tmp_path).encode("fox")[0] == 0


def test_template_whitespace_control_matches_transformers(hf_dir):
  # Block tags on their own indented lines leave no trace (trim_blocks, lstrip_blocks).
  template = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n{{ m['content'] }}\n"
              "    {% endif %}\n{% endfor %}")
  ours = Tokenizer.from_hf_dir(hf_dir)
  ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  ours.chat_template = ref.chat_template = template
  rendered = ours.apply_chat_template(CONVERSATIONS[1])
  assert rendered == "Hi there!\n"
  assert rendered == ref.apply_chat_template(CONVERSATIONS[1], tokenize=False,
                                             add_generation_prompt=True)


def test_template_sandbox_helpers(hf_dir):
  ours = Tokenizer.from_hf_dir(hf_dir)
  ours.chat_template = ("{{ messages[0] | tojson }}{% if messages | length > 1 %}"
                        "{{ raise_exception('one only') }}{% endif %}")
  message = {"role": "user", "content": "<é>"}
  assert ours.apply_chat_template([message]) == '{"role": "user", "content": "<é>"}'  # Unescaped.
  import jinja2
  with pytest.raises(jinja2.exceptions.TemplateError, match="one only"):
    ours.apply_chat_template(CONVERSATIONS[1])


# --- SentencePiece GGUFs ("llama") ---------------------------------------------------------------

def _write_gguf(path, meta):
  """A GGUF holding only tokenizer metadata."""
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
  writer.add_token_list(meta["tokenizer.ggml.tokens"])
  writer.add_token_scores(meta["tokenizer.ggml.scores"])
  writer.add_token_types(meta["tokenizer.ggml.token_type"])
  writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
  writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
  writer.add_unk_token_id(0)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _spm_meta(tokens, scores, types):
  return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0}


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
  # Llama 2's layout: <unk>, <s>, </s>, 256 byte tokens, then pieces; merged pieces score by rank.
  chars = ["▁", "e", "h", "l", "o", "w", "r", "d", "i"]
  # "el" ranks last: merging by the wrong end of the scores would take it first.
  merged = ["ll", "he", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "hi", "▁hi",
            "el"]
  tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *chars, *merged]
  types = [2, 3, 3, *[6] * 256, *[1] * (len(chars) + len(merged))]
  scores = [0.0] * 259 + [-100.0] * len(chars) + [-float(i) for i in range(len(merged))]
  path = tmp_path_factory.mktemp("spm") / "spm.gguf"
  _write_gguf(path, _spm_meta(tokens, scores, types))
  return path


@pytest.mark.parametrize("text",
                         ["hello world", "hi hello\nworld", "héllo wörld 🤖", "hello</s>"])
def test_sentencepiece_gguf_matches_transformers(spm_gguf, text):
  ours = Tokenizer.from_gguf(spm_gguf)
  ref = transformers.AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
  ids = ours.encode(text)
  assert ids == ref.encode(text) and ids[0] == 1  # SentencePiece GGUFs add BOS by default.
  assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text.replace("</s>", "")


def test_sentencepiece_gguf_prefix_space_like_llama_cpp(spm_gguf):
  # llama.cpp (like SentencePiece's add_dummy_prefix) writes "▁" before every run of plain text,
  # even one that starts with a space, and again after a special token. transformers' Metaspace
  # converter does neither, so these are checked by hand.
  ours = Tokenizer.from_gguf(spm_gguf)
  pieces = lambda text: [ours.tokens[i] for i in ours.encode(text, add_special_tokens=False)]
  assert pieces("hello") == ["▁hello"]
  assert pieces(" hello") == ["▁", "▁hello"]
  assert pieces("<s>hello</s>world") == ["<s>", "▁hello", "</s>", "▁world"]
  assert ours.decode(ours.encode(" hello")) == " hello"


def test_sentencepiece_gguf_matches_sentencepiece():
  spm = pytest.importorskip("sentencepiece")
  corpus = ["The quick brown fox jumps over the lazy dog; 12 dogs barked at 3:45.",
            "def add(a, b):\n    return a + b  # sums\n", "héllo wörld, naïve café, 日本語!",
            "Speculative decoding lets a small draft model propose tokens a target verifies."] * 30
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus), model_writer=model, model_type="bpe", vocab_size=400,
      byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
      remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
      minloglevel=2)  # Llama 2's settings.
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  n = sp.GetPieceSize()
  types = [2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 6 if sp.IsByte(i) else 1
           for i in range(n)]
  ours = Tokenizer.from_gguf_metadata(_spm_meta([sp.IdToPiece(i) for i in range(n)],
                                                [sp.GetScore(i) for i in range(n)], types))
  texts = [*corpus[:4], " leading", "  two leading", "tabs\tand\nnewlines\n\n", "zebra ∑ 🤖", ""]
  for text in texts:
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text), text
    assert ours.decode(ids) == sp.decode(ids) == text


# --- Bad input -----------------------------------------------------------------------------------

def test_missing_files_say_what_to_do(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist.*tokenizer.json"):
    Tokenizer.from_hf_dir(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="tokenizer.json.*save_pretrained"):
    Tokenizer.from_hf_dir(tmp_path)
  with pytest.raises(FileNotFoundError, match="GGUF file .*missing.gguf.* not found"):
    Tokenizer.from_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_gguf_token_spelled_twice_keeps_its_id(model):
  """A vocabulary repeating a token string held only the first id: the tokenizer came out one
  id short (another fingerprint) and the later id decoded to nothing."""
  tokens = ["<s>", "a", "b", "ab", "c", "ab"]  # id 5 spells id 3's token
  meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1], "tokenizer.ggml.merges": ["a b"],
          "tokenizer.ggml.scores": [0.0, -1.0, -1.0, -0.5, -1.0, -0.5],
          "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
  with pytest.warns(UserWarning, match="1 duplicate token strings"):
    tok = Tokenizer.from_gguf_metadata(meta)
  assert tok.vocab_size == 6 and tok.tokens[5] == tok.tokens[3]
  assert tok.decode([5, 4]) == tok.decode([3, 4]) != tok.decode([4])


def test_unsupported_gguf_tokenizers_are_refused():
  tokens = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
  with pytest.raises(ValueError, match="'bert' is not supported.*'gpt2'.*'llama'"):
    Tokenizer.from_gguf_metadata({**tokens, "tokenizer.ggml.model": "bert"})
  with pytest.raises(ValueError, match="has no tokenizer"):
    Tokenizer.from_gguf_metadata(tokens)
  with pytest.raises(ValueError, match="pre-tokenizer 'chameleon'"):
    Tokenizer.from_gguf_metadata({**tokens, "tokenizer.ggml.model": "gpt2",
                                  "tokenizer.ggml.pre": "chameleon"})
  with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
    Tokenizer.from_gguf_metadata({**tokens, "tokenizer.ggml.model": "llama"})


def test_stop_ids_from_eos_eot_and_template():
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
          "tokenizer.ggml.tokens": ["a", "b", "ab", "<|im_end|>", "<|endoftext|>", "<|eot_id|>",
                                    "<t>", "<|file_sep|>", "<|end_of_text|>"],
          "tokenizer.ggml.token_type": [1, 1, 1, 3, 3, 3, 4, 3, 3], "tokenizer.ggml.merges": ["a b"],
          "tokenizer.ggml.eos_token_id": 4, "tokenizer.ggml.eot_token_id": 5,
          "tokenizer.chat_template": CHATML}
  ours = Tokenizer.from_gguf_metadata(meta)
  # eos, eot, then every end of generation llama.cpp knows by its text, whatever the template
  # writes (a completion without the template ends at <|endoftext|>-like tokens too: it ran on).
  assert ours.stop_token_ids == (4, 5, 3, 7, 8)
  with pytest.raises(ValueError, match=r"stop string 'x<\|im_end\|>' holds the special token "
                                       r"'<\|im_end\|>' \(id 3\).*one of this tokenizer's stop ids"):
    ours.check_stop_strings(["\n", "x<|im_end|>"])  # decoded text never holds it: never matched
  ours.check_stop_strings(["\n\n", "<t>"])  # <t> is user-defined text: decoded, so it can match
  assert ours.encode("ab<|im_end|>b") == [2, 3, 1]  # Control tokens stay whole...
  assert ours.decode([2, 3, 1]) == "abb"  # ...and are special, so decoding skips them.
  assert ours.encode("a<t>b") == [0, 6, 1] and ours.decode([0, 6, 1]) == "a<t>b"  # User-defined.


BYTE_ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("pre", ["default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2"])
def test_byte_level_pre_tokenizers_round_trip(pre):
  ours = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                       "tokenizer.ggml.tokens": BYTE_ALPHABET})
  text = "Hello 12345 world's\n\n   x = [1, 2]\t🤖 café"
  assert ours.decode(ours.encode(text)) == text


def test_llama3_pre_matches_whole_pieces_and_adds_bos():
  meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [*BYTE_ALPHABET, "ab"],
          "tokenizer.ggml.bos_token_id": 0}
  llama3 = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "llama-bpe"})
  gpt2 = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "gpt2"})
  # Like llama.cpp: a pre-token that is a token is taken whole (no merge makes "ab" here), and BOS
  # is added unless tokenizer.ggml.add_bos_token says otherwise.
  assert llama3.encode("ab") == [0, 256]
  assert gpt2.encode("ab") == [BYTE_ALPHABET.index("a"), BYTE_ALPHABET.index("b")]
  no_bos = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "llama3",
                                         "tokenizer.ggml.add_bos_token": False})
  assert no_bos.encode("ab") == [256]


def test_templates_see_tools_and_documents_as_none():
  """As transformers renders: a template testing `tools is not none` wrote its tools block for
  every prompt (undefined is not none)."""
  template = ("{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]"
              "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
  ours = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                                       "tokenizer.ggml.tokens": ["a", "b", "ab"],
                                       "tokenizer.ggml.merges": ["a b"],
                                       "tokenizer.chat_template": template})
  assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
  assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tools=[1]) == "[TOOLS]hi"


def test_no_chat_template_points_to_the_fix():
  ours = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                                       "tokenizer.ggml.tokens": ["a", "b", "ab"],
                                       "tokenizer.ggml.merges": ["a b"]})
  assert ours.encode("abba") == [2, 1, 0] and ours.stop_token_ids == ()
  with pytest.raises(ValueError, match="no chat template.*--no-chat"):
    ours.apply_chat_template(CONVERSATIONS[0])
