"""`adaptiveload model`: under construction (see the issue that owns this stage)."""
