"""Context parallelism: ``context_parallel`` and ring attention over a sequence-sharded mesh dim."""
