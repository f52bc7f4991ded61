"""Tensor parallelism: the styles (Colwise/Rowwise/Sequence parallel, PrepareModuleInput/Output), ``parallelize_module``, ``loss_parallel``."""
