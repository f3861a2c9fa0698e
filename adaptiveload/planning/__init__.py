"""Batch planning: policies (B(S)), the per-epoch plan, its sampler and its simulator."""
