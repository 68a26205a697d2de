"""Tensor parallelism: weight sharding (pure), the process group with its collective preflight,
and the workers that run rank 1..N-1 in lockstep with the engine's rank 0."""
