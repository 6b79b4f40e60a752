"""Tensor parallelism over torch.distributed: per-rank sharding of a loaded model, and an engine whose
rank 0 schedules and broadcasts each step to the other ranks."""
