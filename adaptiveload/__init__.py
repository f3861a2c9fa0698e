"""AdaptiveLoad: compute-aware data loading for video diffusion-transformer training.

Layers, bottom to top (no module imports from a layer above its own; tests/repo/test_layers.py
holds the list and checks it):

    base         errors, io, progress, tokens, metrics, extras, provenance, experiment (the
                 experiment files and their schema), step_table (the per-step table),
                 lifecycle (stop signals, the parent-death signal), pipeline (what the
                 workflow rules and the package share: layout, variants)
    ops          the LayerNorm-Modulate op and its CUDA build
    model        Wan 2.1 (architectures, the DiT, analytic FLOPs and memory)
    data         manifests, mixtures, bucketing, datasets
    costmodel    the cost of a micro-batch and the budgets it implies
    planning     policies, plans, the batch sampler, the simulator, the paper map
    calibration  measuring the cost model on a device (and the kernel end to end)
    training     the trainer
    tracking     MLflow
    analysis     tables, statistics, figures
    cli          the `adaptiveload` command; jobshell, the shell of every pipeline job

Packages re-export nothing: import from the module that defines a name.
"""

__version__ = "0.1.0"
