"""Checkpoint, tokenizer and data loading."""
