"""The demo: a small Llama-style model trained with tensor and data parallelism (``python -m shardprop.demo``).

Uses the public API only.
"""
