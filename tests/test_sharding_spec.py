"""Chain and tree speculative decoding on 8 simulated CPU devices give the tokens of one device
(a file of its own so the test runner spreads the two slow subprocesses over workers)."""

from tests.test_sharding import run_checks


def test_chains_on_meshes_equal_one_device():
  run_checks("chains")


def test_trees_on_meshes_equal_one_device():
  run_checks("trees")
