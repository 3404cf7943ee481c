"""Parallelisms beyond FSDP/HSDP (distributed.ParallelDims owns the mesh): context parallelism (parallel.cp: each row
split over the cp ranks) and expert parallelism (parallel.ep: each MoE layer's experts split over the ep ranks, tokens
sent to them by all-to-all). Each is a model.Transform; entered from build.py."""
