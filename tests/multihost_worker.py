"""One process of the two-process test of jax.distributed (tests/test_multihost.py): 2 CPU devices
here, 2 in the other, one (dp=2, tp=2) mesh over all 4. Prints the sharded run's tokens and this
process's one-device run's tokens, as JSON lines the test compares. Streamed runs print what the
iteration yielded (each row's pieces joined) beside the stream's output."""

import hashlib
import json
import os
import sys

process_id, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                           process_id=process_id)

from jspec.drafting.model import ModelDrafter  # noqa: E402
from jspec.generate import generate, generate_stream  # noqa: E402
import numpy as np  # noqa: E402

from jspec.models.llama import param_layout  # noqa: E402
from jspec.models.vocab_trim import output_table  # noqa: E402
from jspec.sharding import make_mesh, model_placement, to_host  # noqa: E402
from jspec.speculative.chain import (SpecConfig, speculative_generate,  # noqa: E402
                                     speculative_generate_stream)
from tests.sharding_checks import DRAFT, PROMPTS, SAMPLED, TARGET, models  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4 and jax.local_device_count() == 2
target, draft = models()
mesh = make_mesh(dp=2, tp=2)  # each dp row one process's 2 devices; tp's all-reduces stay local
drafter = ModelDrafter(draft, DRAFT)
spec = SpecConfig(gamma=3, max_new_tokens=10)
runs = {
    "generate": lambda m: generate(target, TARGET, PROMPTS, max_new_tokens=10, mesh=m),
    "sampled": lambda m: generate(target, TARGET, PROMPTS, max_new_tokens=10, sampling=SAMPLED,
                                  key=4, mesh=m),
    "chain": lambda m: speculative_generate(target, TARGET, drafter, PROMPTS, spec=spec, mesh=m),
}
for name, run in runs.items():
  print(json.dumps({"run": name, "process": process_id, "sharded": run(mesh).sequences(),
                    "local": run(None).sequences()}), flush=True)


def streamed(stream, halt_first_row: bool = False):
  """(each row's yielded pieces joined, the stream's output); halt_first_row: row 0 halted after
  the first piece, as a reader that found a stop string would (every process halts it)."""
  rows = [[] for _ in PROMPTS]
  for i, new in enumerate(stream):
    for row, piece in zip(rows, new):
      row.extend(piece)
    if halt_first_row and i == 0:
      stream.halt([0])
  return rows, stream.output.sequences()


streams = {
    "generate-stream": (lambda m: generate_stream(target, TARGET, PROMPTS, max_new_tokens=10,
                                                  mesh=m, every=3), runs["generate"]),
    "chain-stream": (lambda m: speculative_generate_stream(target, TARGET, drafter, PROMPTS,
                                                           spec=spec, mesh=m, every=2),
                     runs["chain"]),
}
for name, (stream, whole) in streams.items():
  want = whole(None).sequences()
  print(json.dumps({"run": name, "process": process_id, "sharded": streamed(stream(mesh)),
                    "local": [want, want]}), flush=True)
# Halted: row 0 stops early, a prefix of its whole run (the same on both processes); the others
# run on to the end.
rows, out = streamed(streams["generate-stream"][0](mesh), halt_first_row=True)
want = runs["generate"](None).sequences()
print(json.dumps({"run": "generate-stream-halt", "process": process_id,
                  "sharded": [rows[1:], out[1:], rows[0] == out[0] == want[0][:len(out[0])],
                              len(out[0]) < len(want[0])],
                  "local": [want[1:], want[1:], True, True], "halted": out[0]}), flush=True)
# A host copy of a placed weight (what loading a compact drafter reads from the target): the
# output table split over tp and replicated over dp spans both processes.
placed = model_placement(TARGET, mesh).put(target, param_layout(TARGET))
digest = lambda a: hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()
print(json.dumps({"run": "to_host", "process": process_id,
                  "sharded": digest(to_host(output_table(placed))),
                  "local": digest(np.asarray(output_table(target)))}), flush=True)
jax.distributed.shutdown()
