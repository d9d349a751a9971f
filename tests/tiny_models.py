"""The small random model most test files build: a 2-layer Llama over a 97-token vocabulary (a
prime, so no shape lines up with another by chance), GQA 4 query / 2 KV heads."""

import dataclasses

from jspec.models.config import Config

SMALL = Config(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
               num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
SMALL_512 = dataclasses.replace(SMALL, max_position_embeddings=512)  # long-prompt tests
