"""jspec: speculative decoding and KV-cache compression for Llama-family LLMs in JAX."""

__version__ = "0.1.0"
