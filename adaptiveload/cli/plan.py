"""`adaptiveload plan`: under construction (see the issue that owns this stage)."""
