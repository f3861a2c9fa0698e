"""Training Wan 2.1 on a plan: objective, one loop for emulated and distributed ranks."""
