"""jspec's GGUF reader against gguf-py's: the same metadata, and every block format decoded to the
same floats, bit for bit (random blocks, so a wrong nibble order or scale index cannot pass)."""

import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import ggufutil  # noqa: E402

from jspec.io import gguf_file  # noqa: E402
from jspec.io.gguf_file import GGUFFile, dequantize  # noqa: E402

# Byte offsets of the float16 scale fields in each format's block; every other byte is random.
F16_FIELDS = {gguf_file.Q4_0: (0,), gguf_file.Q4_1: (0, 2), gguf_file.Q5_0: (0,),
              gguf_file.Q5_1: (0, 2), gguf_file.Q8_0: (0,), gguf_file.Q4_K: (0, 2),
              gguf_file.Q5_K: (0, 2), gguf_file.Q6_K: (208,)}


def random_blocks(kind: int, rows: int, blocks: int, rng) -> np.ndarray:
  """[rows, blocks * bytes per block] uint8 of random blocks with finite float16 scales."""
  if kind in (gguf_file.F32, gguf_file.F16, gguf_file.BF16):
    values = rng.standard_normal((rows, blocks)).astype(np.float32)
    if kind == gguf_file.F16:
      return values.astype(np.float16).view(np.uint8)
    if kind == gguf_file.BF16:
      return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.view(np.uint8)
  _, size = gguf_file.BLOCK[kind]
  raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
  for at in F16_FIELDS[kind]:
    scale = rng.standard_normal((rows, blocks)).astype(np.float16)
    raw[:, :, at:at + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
  return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(gguf_file.BLOCK), ids=lambda k: gguf_file.TYPE_NAMES[k])
def test_every_format_decodes_like_gguf_py(kind):
  rng = np.random.default_rng(kind)
  rows, blocks = 5, 3
  raw = random_blocks(kind, rows, blocks, rng)
  ours = dequantize(gguf_file._UNPACK[kind](raw.reshape(rows, blocks, -1), rows))
  ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(kind))
  np.testing.assert_array_equal(ours, ref.reshape(ours.shape))


def test_unpacked_q_is_small_integers_with_one_scale_per_sub_block():
  raw = random_blocks(gguf_file.Q4_K, 2, 2, np.random.default_rng(0))
  b = gguf_file._UNPACK[gguf_file.Q4_K](raw.reshape(2, 2, -1), 2)
  assert b.q.dtype == np.int8 and b.q.shape == (2, 512) and 0 <= b.q.min() and b.q.max() <= 15
  assert b.scale.shape == b.offset.shape == (2, 512 // b.sub) and b.sub == 32


def _written(tmp_path, quant):
  _, config, sd = ggufutil.tiny_hf_checkpoint(tmp_path / "hf", "llama")
  return ggufutil.write_gguf(tmp_path / "m.gguf", config, sd, "llama", quant=quant)


@pytest.mark.parametrize("quant", ["F32", "F16", "Q8_0"])
def test_a_written_file_reads_like_gguf_py(tmp_path, quant):
  path = _written(tmp_path, quant)
  ours, ref = GGUFFile(path), gguf.GGUFReader(path)
  fields = {name: f.contents() for name, f in ref.fields.items() if not name.startswith("GGUF.")}
  assert ours.metadata == fields
  assert list(ours.tensors) == [t.name for t in ref.tensors]
  for t in ref.tensors:
    info = ours.tensors[t.name]
    assert info.ggml_type == int(t.tensor_type)
    expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    np.testing.assert_array_equal(ours.tensor(t.name), expected.reshape(info.shape))


def test_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    GGUFFile(tmp_path / "missing.gguf")
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"PK\x03\x04" + bytes(40))
  with pytest.raises(ValueError, match="not a GGUF file"):
    GGUFFile(bad)
  # A tensor in a format jspec does not decode (Q2_K) names the format and the fix.
  path = tmp_path / "q2k.gguf"
  writer = gguf.GGUFWriter(path, "llama")
  _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
  writer.add_tensor("w", np.zeros((2, size), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  f = GGUFFile(path)
  assert f.tensors["w"].shape == (2, 256)
  with pytest.raises(ValueError, match="Q2_K.*re-quantize"):
    f.tensor("w")


def test_a_truncated_file_says_so_with_the_missing_bytes(tmp_path):
  """An interrupted download (the first part of a real file) is named as truncated, with the bytes
  its tensors need and the bytes it has, instead of failing later in a reshape."""
  whole = _written(tmp_path, "F32").read_bytes()
  ref = GGUFFile(_written(tmp_path, "F32"))
  end = max(t.offset + t.nbytes for t in ref.tensors.values())
  assert end == len(whole)  # the check's own arithmetic, on an intact file
  for keep in (len(whole) - 1, len(whole) * 2 // 3):
    cut = tmp_path / f"cut{keep}.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(ValueError, match=f"truncated or corrupt.*need {len(whole):,} bytes.*"
                                         f"has {keep:,} \\({len(whole) - keep:,} missing\\)"):
      GGUFFile(cut)
  header = tmp_path / "header.gguf"  # cut inside the metadata
  header.write_bytes(whole[:40])
  with pytest.raises(ValueError, match="truncated or corrupt: its header"):
    GGUFFile(header)
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="is empty"):
    GGUFFile(empty)


def _table_field(raw: bytes, name: str) -> int:
  """Byte position of the tensor-table entry of `name` (a one-character name), after its name."""
  return raw.index(b"\x01" + bytes(7) + name.encode()) + 9


@pytest.mark.parametrize("corruption, message", [
    ("overlap", "tensor 'b' has offset 0, expected 256"),
    ("misaligned", "tensor 'b' has offset 260, not a multiple of the alignment 32"),
    ("duplicate", "tensor 'a' is listed twice"),
    ("alignment", "general.alignment=0 is not a power of two"),
    ("no dims", "tensor 'a' has 0 dimensions"),
    ("overflow", "more than 2\\*\\*63 elements"),
])
def test_a_corrupt_tensor_table_is_refused(tmp_path, corruption, message):
  """The table was read as written: a tensor pointed into another's bytes, at a misaligned
  offset, or named twice loaded the wrong numbers without an error (llama.cpp refuses each);
  other corrupt fields surfaced as ZeroDivisionError / IndexError / a numpy reshape error."""
  path = tmp_path / "two.gguf"
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_uint32("general.alignment", 32)  # gguf's default, stated
  writer.add_tensor("a", np.arange(64, dtype=np.float32).reshape(2, 32))
  writer.add_tensor("b", -np.arange(64, dtype=np.float32).reshape(2, 32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  intact = path.read_bytes()
  assert np.asarray(GGUFFile(path).tensor("b"))[0, 1] == -1  # the check passes a good file
  raw = bytearray(intact)
  b = _table_field(raw, "b")  # n_dims (4 bytes), dims (8 each), type (4), offset (8)
  if corruption == "alignment":
    key = raw.index(b"general.alignment") + len("general.alignment")
    struct.pack_into("<I", raw, key + 4, 0)  # after the value type
  elif corruption == "overlap":
    struct.pack_into("<Q", raw, b + 4 + 16 + 4, 0)
  elif corruption == "misaligned":
    struct.pack_into("<Q", raw, b + 4 + 16 + 4, 260)
  elif corruption == "duplicate":
    raw[b - 1] = ord("a")
  elif corruption == "no dims":
    a = _table_field(raw, "a")
    raw[a:a + 4 + 16] = struct.pack("<I", 0) + bytes(16)  # zero dims; the 16 bytes become noise
  elif corruption == "overflow":
    struct.pack_into("<Q", raw, b + 4 + 8, 2**59)
  path.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=f"truncated or corrupt.*{message}"):
    GGUFFile(path)
