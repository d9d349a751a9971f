"""The "tiny random draft" of the speculative benchmarks: 2 layers, width 128, every weight random,
the default target's tokenizer; saved as an HF directory both jspec and transformers load."""

import jax

from jspec.io.fetch import cache_dir
from jspec.io.save import save_hf
from jspec.model import load
from jspec.models.drafter import drafter_config
from jspec.train.drafter import init_drafter

target = load("default")
cfg = drafter_config(target.cfg, num_layers=2, hidden_size=128)
params = init_drafter(target.params, target.cfg, cfg, jax.random.key(0), init="random")
print(save_hf(cache_dir() / "drafters" / "random-2x128", cfg, params, target.tokenizer,
              {"init": "random", "seed": 0}))
