"""Multi-host through JAX's own runtime: two processes on localhost (jax.distributed, CPU devices,
gloo collectives), one (dp=2, tp=2) mesh over both processes' devices. Every process reads the
sharded run's tokens, whole or streamed (a row halted by both), and they equal what one device
computes (tests/multihost_worker.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("multihost_worker.py")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_give_the_single_process_tokens():
  port = free_port()
  env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent))
  env["XLA_FLAGS"] = os.environ.get("JSPEC_TEST_XLA_FLAGS", "")  # the suite's (conftest), no other
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=600)
      assert p.returncode == 0, err[-4000:]
      outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
  finally:
    for p in procs:
      p.kill()
  assert [len(o) for o in outs] == [7, 7], outs
  for records in zip(*outs):
    assert len({r["run"] for r in records}) == 1
    for r in records:
      assert r["sharded"] == r["local"], r["run"]
    assert records[0]["sharded"] == records[1]["sharded"], records[0]["run"]
    assert records[0].get("halted") == records[1].get("halted")
