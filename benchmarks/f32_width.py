"""What a forward of T tokens costs against a one-token step, per float32 kernel, side by side.

A verification block of gamma + 1 tokens is one forward of that width; speculation wins only if
it costs little more than a one-token step. XLA:CPU's float32 dot slows at 2-8 rows, jspec's
float32 kernel (`--weights float32` on CPU) does not as much:

  python benchmarks/f32_width.py --json benchmarks/issue20_f32_width_cpu.json
"""

import argparse

from jspec.bench.profiling import save_script_record
from jspec.bench.round_split import forward_width_s
from jspec.io.load import load_checkpoint


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="default")
  p.add_argument("--formats", default="float32,float32-xla")
  p.add_argument("--widths", default="1,2,3,4,5,8,16")
  p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
  p.add_argument("--json", default="benchmarks/issue20_f32_width_cpu.json")
  args = p.parse_args()
  widths = tuple(int(w) for w in args.widths.split(","))
  record = {"model": args.model, "context": args.context, "formats": {}}
  for name in args.formats.split(","):
    cfg, params, _, _ = load_checkpoint(args.model, name)
    times = forward_width_s(params, cfg, widths, context=args.context)
    one = times[widths[0]]["total_s"]
    record["formats"][name] = {str(T): {**t, "vs_first_width": t["total_s"] / one}
                               for T, t in times.items()}
    del params
  first, *rest = args.formats.split(",")
  for other in rest:  # the side-by-side ratio: the other format's time over the first's
    record[f"{other}_over_{first}"] = {
        str(T): record["formats"][other][str(T)]["total_s"] / record["formats"][first][str(T)]["total_s"]
        for T in widths}
  save_script_record(record, args.json)


if __name__ == "__main__":
  main()
