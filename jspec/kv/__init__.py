"""KV-cache compression: a fixed budget of cache slots per row, kept by eviction.

`policy.KVPolicy` (static settings), `scores` (which slots deserve to stay, one pure function per
method), `evict` (keep the best `budget` slots of every layer and KV head in slots [0, budget),
the kept newest entries moved into the slots the dropped ones free, with their original RoPE
positions baked into the keys and recorded beside them) and `prefill` (a prompt of any length, C
tokens at a time, evicting down to the budget after each chunk, as KeyDiff does).
"""
