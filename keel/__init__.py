"""Keel: GRPO for multi-step tool use, with the supervision signals that prevent collapse and the
diagnostics that catch it. Importing the package caps oneDNN's per-shape caches before any bf16
matrix multiply runs (keel.memory.limit_onednn_caches)."""

from keel.memory import limit_onednn_caches

limit_onednn_caches()
