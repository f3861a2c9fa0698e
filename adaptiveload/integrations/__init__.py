"""The plan's batch sampler inside training frameworks, where the framework's own counters
would otherwise drop a resume or a step: ``accelerate.prepare`` (HF Accelerate) and
``lightning.PlanDataLoader`` (Lightning). Each needs its framework installed; nothing else in
the package imports them. docs/sampler.md has the recipes, run by the test suite."""
