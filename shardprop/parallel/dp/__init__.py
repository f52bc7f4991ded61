"""Data parallelism over one mesh dim: bucketed gradient all-reduce (as DDP does)."""
