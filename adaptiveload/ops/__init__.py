"""Custom operators (the fused LayerNorm-Modulate kernel's Python side)."""
