"""AdaptiveLoad: compute-aware data loading for video diffusion-transformer training.

Dependency direction (no module imports "upwards"):
    data -> planning -> training -> tracking -> analysis
with `tokens`, `metrics`, `costmodel`, `errors`, `extras`, `progress`, `io` and `lifecycle`
as leaf helpers usable from anywhere (`jobshell`, the pipeline's job shell, uses only
`lifecycle`).
"""

__version__ = "0.1.0"
