"""Why a scanned decoder decodes slower than an unrolled one on XLA's CPU dots: a layer loop of
matrix-vector products over [L, ...]-stacked weights (the decode step's shape, no jspec code), as
a `lax.scan`, a `fori_loop`, an unrolled loop over separate arrays, and an unrolled loop over
static slices of the stacked arrays; and, in the scan's optimized HLO, the loop fusions that copy
each layer's dynamic slice out before its dot reads it.

  python benchmarks/scan_slice_copy.py [--layers 30 --embed 576 --mlp 1536 --calls 50]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

from jspec.bench.profiling import machine_info


def layer(x, w_in, w_out):
  return x + jnp.tanh(x @ w_in) @ w_out  # [1, E]


@jax.jit
def scanned(x, w_in, w_out):
  return jax.lax.scan(lambda x, ws: (layer(x, *ws), None), x, (w_in, w_out))[0]


@jax.jit
def fori(x, w_in, w_out):
  return jax.lax.fori_loop(0, w_in.shape[0], lambda i, x: layer(x, w_in[i], w_out[i]), x)


@jax.jit
def unrolled_arrays(x, w_ins, w_outs):
  for w_in, w_out in zip(w_ins, w_outs):
    x = layer(x, w_in, w_out)
  return x


@jax.jit
def unrolled_static_slices(x, w_in, w_out):
  for i in range(w_in.shape[0]):
    x = layer(x, w_in[i], w_out[i])
  return x


def per_call_ms(fn, *args, calls: int) -> float:
  fn(*args).block_until_ready()
  start = time.perf_counter()
  for _ in range(calls):
    fn(*args).block_until_ready()
  return (time.perf_counter() - start) / calls * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, default=30)
  ap.add_argument("--embed", type=int, default=576)
  ap.add_argument("--mlp", type=int, default=1536)
  ap.add_argument("--calls", type=int, default=50)
  args = ap.parse_args()
  L, E, F = args.layers, args.embed, args.mlp
  key_in, key_out = jax.random.split(jax.random.key(0))
  w_in = jax.random.normal(key_in, (L, E, F)) * 0.02  # the default model's MLP shapes
  w_out = jax.random.normal(key_out, (L, F, E)) * 0.02
  x = jnp.ones((1, E))
  print(machine_info())
  print(f"{L} layers of [1, {E}] x [{E}, {F}] x [{F}, {E}] ({2 * L * E * F * 4 / 1e6:.0f} MB of "
        f"weights), ms a call (mean of {args.calls} calls):")
  runs = {"lax.scan over stacked": (scanned, x, w_in, w_out),
          "fori_loop over stacked": (fori, x, w_in, w_out),
          "unrolled, separate arrays": (unrolled_arrays, x, list(w_in), list(w_out)),
          "unrolled, static slices of stacked": (unrolled_static_slices, x, w_in, w_out)}
  times = {name: per_call_ms(*run, calls=args.calls) for name, run in runs.items()}
  base = times["unrolled, separate arrays"]
  for name, ms in times.items():
    print(f"  {name:36} {ms:7.2f} ms  {ms / base:5.2f}x the separate arrays")
  hlo = scanned.lower(x, w_in, w_out).compile().as_text()
  copies = re.findall(r"%dynamic-slice\S*fusion\S* = f32\[([\d,]+)\]", hlo)
  print(f"scan's optimized HLO: {len(copies)} dynamic-slice loop fusions a layer, shapes "
        f"{sorted(set(copies))} (each a copy of the layer's weight, which the dot then reads)")


if __name__ == "__main__":
  main()
