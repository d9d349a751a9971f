"""Run tests against jspec's native CPU kernels built for another -march than this CPU's.

On an AVX-512 machine `-march=native` compiles the kernels' AVX-512 code only; the portable code
(CPUs without AVX-512: most AMD and laptop CPUs) runs only in a build for an older target:

  python scripts/native_portable.py x86-64 tests/test_native.py
  python scripts/native_portable.py x86-64-v3 tests/test_quant.py -m "not slow"

The build is cached beside the native one (keyed by its flags); its own process, because the
kernels register under fixed names.
"""

import sys

import pytest

import jspec.native as native


def main(march: str, args: list[str]) -> int:
  native.FLAGS = tuple(f"-march={march}" if f == "-march=native" else f for f in native.FLAGS)
  path = native.kernel_path()
  print(f"jspec native kernels built with -march={march}: {path} code", flush=True)
  if path != "portable":
    print(f"-march={march} compiles the AVX-512 code, not the portable one", file=sys.stderr)
    return 2
  return pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", *args])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1], sys.argv[2:]))
