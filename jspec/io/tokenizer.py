"""Text <-> token ids, chat template and stop ids, from a Hugging Face directory or a GGUF file.

`Tokenizer` wraps a `tokenizers.Tokenizer`. From an HF directory the backend is `tokenizer.json`
as shipped; from a GGUF it is rebuilt from llama.cpp's metadata the way llama.cpp tokenizes:
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges, split first by the
  regexes llama.cpp picks for `tokenizer.ggml.pre`;
- `tokenizer.ggml.model == "llama"`: SentencePiece BPE (Llama 2 and kin), merges recovered from
  the token scores, byte fallback, a "▁" prefix on every run of plain text.
Control (and unknown) tokens become special added tokens and user-defined ones plain added tokens,
so both stay whole when they occur in text (as after a chat template).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from jspec.io.files import read_json
from jspec.io.gguf_file import GGUFFile

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn when a chat template writes them; ids found in the template join stops.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                    "<|endoftext|>", "<|end_of_text|>")
# What llama.cpp ends generation on besides eos/eot/eom, by token text, whatever the chat template
# says: the turn ends above and fill-in-the-middle's pad / repository / file-separator tokens (a
# model that writes one has ended its document). GGUF files are read as llama.cpp reads them.
_GGUF_END_TOKENS = (*_TURN_END_TOKENS, "<EOT>", "_<EOT>", "<|fim_pad|>", "<fim-pad>", "<PAD>",
                    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
                    "<|file_sep|>")

# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe applies them (one after another).
_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SINGLE_DIGITS = r"\p{N}"

# `tokenizer.ggml.pre` -> regexes. "default" (and a missing key) takes GPT-2's, as transformers
# does; llama.cpp's own fallback adds three odd punctuation/digit splits that no model trained with.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"),
                    (_SINGLE_DIGITS, _GPT2_SPLIT)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                    (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2_SPLIT,)),
}
# llama.cpp matches a whole pre-token against the vocabulary before merging for these (as the
# `ignore_merges` of Llama 3's tokenizer.json), and adds BOS unless the file says otherwise;
# smaug-bpe and dbrx split as Llama 3 does but do neither.
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3")


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  extra = [b for b in range(256) if b not in printable]
  return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the model's special ids, BOS policy and chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
               eos_token_id: int | None = None, add_bos: bool = False,
               chat_template: str | None = None, extra_stop_ids: Iterable[int] = (),
               bos_token: str | None = None, eos_token: str | None = None,
               aliases: Mapping[int, int] | None = None):
    self.backend = backend
    # GGUF vocabularies can spell two ids alike; the backend holds the first, so a later one is
    # decoded (and fingerprinted) as the first id it repeats.
    self.aliases = dict(aliases or {})
    self.bos_token_id = bos_token_id
    self.eos_token_id = eos_token_id
    self.add_bos = bool(add_bos) and bos_token_id is not None
    self.chat_template = chat_template or None
    # Ids can have holes (a tokenizer.json may skip some); the embedding still has a row for them.
    vocab = backend.get_vocab(with_added_tokens=True)
    self.vocab_size = max([*vocab.values(), *self.aliases]) + 1 if vocab else 0
    self.tokens: list[str] = [backend.id_to_token(self.aliases.get(i, i)) or ""
                              for i in range(self.vocab_size)]
    self.bos_token = bos_token if bos_token is not None else self._token_or_none(bos_token_id)
    self.eos_token = eos_token if eos_token is not None else self._token_or_none(eos_token_id)
    stops = [eos_token_id, *extra_stop_ids]
    if self.chat_template:
      stops += [backend.token_to_id(t) for t in _TURN_END_TOKENS if t in self.chat_template]
    self.stop_token_ids: tuple[int, ...] = tuple(
        dict.fromkeys(int(i) for i in stops if i is not None and 0 <= int(i) < self.vocab_size))

  def _token_or_none(self, token_id: int | None) -> str | None:
    return None if token_id is None else self.backend.id_to_token(int(token_id))

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, add_bos={self.add_bos}, stop_ids={self.stop_token_ids}, "
            f"chat_template={'yes' if self.chat_template else 'no'})")

  @functools.cached_property
  def fingerprint(self) -> str:
    """SHA-256 of the vocabulary (every id's token string, in order): the same for the same
    tokenizer whether it came from tokenizer.json or a GGUF file; data (distillation sets, n-gram
    datastores) made with another differs."""
    return hashlib.sha256("\n".join(self.tokens).encode("utf-8")).hexdigest()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; special tokens written in it stay whole; BOS first if `add_bos`."""
    # The backend's own post-processor is bypassed so BOS follows one rule for every source.
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if add_special_tokens and self.add_bos:
      ids = [self.bos_token_id, *ids]
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids` (any iterable of ints, e.g. a numpy row)."""
    ids = [self.aliases.get(int(i), int(i)) for i in ids]
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def special_tokens(self) -> dict[str, int]:
    """{text: id} of the special tokens, which `decode` skips by default."""
    return {t.content: int(i) for i, t in self.backend.get_added_tokens_decoder().items()
            if t.special}

  def check_stop_strings(self, stop_strings: Sequence[str]) -> None:
    """Stop strings are matched in decoded text, which never holds a special token's text: one
    that contains it could never match (transformers' StopStringCriteria, which reads token
    strings, would). Refused, naming the token's id."""
    for text, token_id in self.special_tokens().items():
      for stop in stop_strings:
        if text in stop:
          where = ("it is one of this tokenizer's stop ids already (on with stop=True)"
                   if token_id in self.stop_token_ids else
                   f"pass stop_ids=({token_id},) to jspec.generate / the engines")
          raise ValueError(
              f"stop string {stop!r} holds the special token {text!r} (id {token_id}), which "
              f"decoded text never shows, so it would never match. Fix: stop on the token's id: "
              f"{where}")

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The prompt string for `messages` ([{"role": ..., "content": ...}, ...]).

    It already holds any BOS the template writes: encode it with add_special_tokens=False.
    """
    if not self.chat_template:
      raise ValueError(
          "this tokenizer has no chat template (none in the GGUF metadata or "
          "tokenizer_config.json), so chat messages cannot be turned into a prompt. Fix: pass "
          "--no-chat to use the raw prompt text, or use a chat/instruct model that ships a chat "
          "template.")
    # tools and documents as transformers passes them (None unless given): a template that tests
    # `tools is not none` would otherwise see them undefined, which is not none.
    return _compile_template(self.chat_template).render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        **{"tools": None, "documents": None, **kwargs})

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """From a Hugging Face model directory: tokenizer.json plus its config files."""
    path = Path(path)
    if not path.is_dir():
      raise FileNotFoundError(
          f"tokenizer directory {str(path)!r} does not exist. Fix: pass a Hugging Face model "
          f"directory that holds tokenizer.json, or a .gguf file.")
    file = path / "tokenizer.json"
    if not file.is_file():
      raise FileNotFoundError(
          f"{str(file)!r} not found: jspec reads the fast-tokenizer file tokenizer.json. Fix: if "
          f"the model has only a slow tokenizer (tokenizer.model), write tokenizer.json once with "
          f"`transformers.AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`, or use its "
          f"GGUF.")
    try:
      backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
      raise ValueError(f"{file} is not a valid tokenizer.json ({e}). Fix: restore the file from "
                       f"the checkpoint") from None
    config = read_json(path / "tokenizer_config.json", missing_ok=True)
    special = read_json(path / "special_tokens_map.json", missing_ok=True)
    generation = read_json(path / "generation_config.json", missing_ok=True)

    def token(name: str) -> str | None:
      value = config.get(name) or special.get(name)
      return value.get("content") if isinstance(value, dict) else value

    def token_id(name: str) -> int | None:
      text = token(name)
      found = backend.token_to_id(text) if text is not None else None
      return found if found is not None else _first(generation.get(f"{name}_id"))

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    add_bos = config.get("add_bos_token")
    if add_bos is None:
      # No flag: trust tokenizer.json's post-processor (Llama 3's adds BOS there).
      probe = backend.encode("", add_special_tokens=True).ids
      add_bos = bos_id is not None and probe[:1] == [bos_id]
    gen_eos = generation.get("eos_token_id")
    return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, add_bos=add_bos,
               chat_template=_hf_chat_template(path, config),
               extra_stop_ids=gen_eos if isinstance(gen_eos, list) else [gen_eos],
               bos_token=token("bos_token"), eos_token=token("eos_token"))

  @classmethod
  def from_gguf(cls, file_or_path: Any) -> "Tokenizer":
    """From a GGUF file's tokenizer metadata (a path or an open `jspec.io.gguf_file.GGUFFile`)."""
    gguf = file_or_path if isinstance(file_or_path, GGUFFile) else GGUFFile(file_or_path)
    return cls.from_gguf_metadata({name: value for name, value in gguf.metadata.items()
                                   if name.startswith("tokenizer.")})

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
    """From GGUF metadata already read into a dict ({"tokenizer.ggml.tokens": [...], ...})."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
      backend, add_bos_default, aliases = _byte_level_bpe(meta)
    elif kind == "llama":
      (backend, aliases), add_bos_default = _sentencepiece_bpe(meta), True
    elif kind is None or kind == "none":
      raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model is missing or "
                       "'none'). Fix: use a GGUF converted with its vocabulary.")
    else:
      raise ValueError(
          f"GGUF tokenizer model {kind!r} is not supported; jspec builds 'gpt2' (byte-level BPE) "
          f"and 'llama' (SentencePiece BPE) tokenizers. Fix: use a model with one of those, or its "
          f"Hugging Face directory (tokenizer.json).")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ends = [i for i, t in enumerate(tokens) if t in _GGUF_END_TOKENS]
    return cls(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
               eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
               add_bos=meta.get("tokenizer.ggml.add_bos_token", add_bos_default),
               chat_template=meta.get("tokenizer.chat_template"), aliases=aliases,
               extra_stop_ids=[meta.get(f"tokenizer.ggml.{name}_token_id")
                               for name in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")] + ends)


def _first(value: Any) -> int | None:
  """An id given as int or list of ints (generation_config's eos_token_id may be a list)."""
  if isinstance(value, list):
    return value[0] if value else None
  return value


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
  """chat_template.jinja (newer transformers save it apart) or tokenizer_config's template."""
  if (path / "chat_template.jinja").is_file():
    return (path / "chat_template.jinja").read_text(encoding="utf-8")
  template = config.get("chat_template")
  if isinstance(template, list):  # Named templates: [{"name": "default", "template": ...}, ...].
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default", next(iter(named.values()), None))
  return template


@functools.lru_cache(maxsize=16)  # one compile per template, not one per prompt
def _compile_template(source: str):
  """Compile a chat template in jinja2's immutable sandbox, with transformers' extras."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own filter HTML-escapes; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format):
    import datetime
    return datetime.datetime.now().strftime(format)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
  return env.from_string(source)


def _gguf_tokens(meta: Mapping[str, Any]) -> tuple[list[str], list[int]]:
  tokens = list(meta["tokenizer.ggml.tokens"])
  types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
  if len(types) != len(tokens):
    raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
  return tokens, types


def _vocab(tokens: Sequence[str]) -> tuple[dict[str, int], dict[int, int]]:
  """{token: id} with the first id of a repeated token string (as llama.cpp's text -> id map),
  and {later id: first id} for the repeats."""
  vocab: dict[str, int] = {}
  for i, token in enumerate(tokens):
    vocab.setdefault(token, i)
  aliases = {i: vocab[token] for i, token in enumerate(tokens) if vocab[token] != i}
  if aliases:
    warnings.warn(f"GGUF vocabulary has {len(aliases)} duplicate token strings; their later ids "
                  f"cannot be produced by encoding (they decode as the first)")
  return vocab, aliases


def _add_special(backend: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]):
  """Control/unknown tokens as special added tokens, user-defined ones as plain added tokens."""
  # normalized=False: matched in the raw text, before the SentencePiece "▁" rewrite.
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)])
  backend.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, k in zip(tokens, types) if k == _USER_DEFINED])


def _byte_level_bpe(meta: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer, bool,
                                                       dict[int, int]]:
  """GPT-2-style byte-level BPE, as llama.cpp's LLAMA_VOCAB_TYPE_BPE; also the BOS default."""
  pre = meta.get("tokenizer.ggml.pre") or "default"
  if pre not in _PRE_SPLITS:
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known: "
        f"{sorted(_PRE_SPLITS)}. Tokenizing with another pre-tokenizer's rules would silently "
        f"give ids the model was not trained on. Fix: use the model's Hugging Face directory "
        f"(tokenizer.json).")
  tokens, types = _gguf_tokens(meta)
  # Plain tokens are spelled in GPT-2's byte alphabet; added ones are stored as raw text and keep
  # that spelling so they map to their own ids. Respell the odd plain one that is raw text.
  spelled = [t if k in (_CONTROL, _USER_DEFINED, _UNKNOWN) or set(t) <= _BYTE_ALPHABET
             else "".join(_BYTE_CHARS[b] for b in t.encode("utf-8"))
             for t, k in zip(tokens, types)]
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
  ignore_merges = pre in _LLAMA3_PRES
  vocab, aliases = _vocab(spelled)
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False))
  backend.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
      + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  _add_special(backend, spelled, types)
  return backend, ignore_merges, aliases


def _sentencepiece_bpe(meta: Mapping[str, Any]) -> tuple[tokenizers.Tokenizer,
                                                         dict[int, int]]:
  """SentencePiece BPE (llama.cpp's LLAMA_VOCAB_TYPE_SPM) from tokens and scores."""
  tokens, types = _gguf_tokens(meta)
  scores = meta.get("tokenizer.ggml.scores")
  if scores is None or len(scores) != len(tokens):
    raise ValueError("GGUF SentencePiece vocabulary ('llama') needs tokenizer.ggml.scores, one per "
                     "token, to rank merges; this file has none or the wrong number.")
  vocab, aliases = _vocab(tokens)
  # SentencePiece BPE merges the adjacent pair whose concatenation is the highest-scoring piece.
  # BPE ranks reproduce that: every split of a plain piece into two pieces is a merge, ranked by
  # the piece's score. Only plain pieces take part: the others are matched whole or never arise.
  mergeable = {t for t, k in zip(tokens, types) if k == _NORMAL}
  ranked = []
  for token in mergeable:
    i = vocab[token]
    for cut in range(1, len(token)):
      left, right = token[:cut], token[cut:]
      if left in mergeable and right in mergeable:
        ranked.append((-scores[i], i, vocab[left], left, right))
  ranked.sort()
  unk_id = meta.get("tokenizer.ggml.unknown_token_id")
  unk = tokens[unk_id] if unk_id is not None else next(
      (t for t, k in zip(tokens, types) if k == _UNKNOWN), None)
  backend = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=[(left, right) for *_, left, right in ranked], unk_token=unk,
      fuse_unk=True, byte_fallback=True))
  # llama.cpp writes a space before every run of plain text (the start, and after each special
  # token) and spaces as "▁": SentencePiece's add_dummy_prefix, even if the text starts with one.
  rules = [normalizers.Replace(" ", "▁")]
  if meta.get("tokenizer.ggml.add_space_prefix", True):
    rules.insert(0, normalizers.Prepend("▁"))
  backend.normalizer = normalizers.Sequence(rules)
  backend.pre_tokenizer = None
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if meta.get("tokenizer.ggml.add_space_prefix", True):
    steps.append(decoders.Strip(content=" ", left=1))
  backend.decoder = decoders.Sequence(steps)
  _add_special(backend, tokens, types)
  return backend, aliases
