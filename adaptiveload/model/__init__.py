"""Wan 2.1 T2V DiT (trainable, faithful to the official code) and its configurations."""
