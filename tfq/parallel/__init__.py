"""Tensor parallelism with one process's bits: the model split by whole heads and output columns over ranks that
tfq starts itself (docs/tensor-parallel.md)."""
