"""Batch planning: which samples form each micro-batch, and which rank runs it in which step.

- ``policies``: B(S) rules (``equal-token``, ``adaptiveload``, ``adaptiveload-balanced``),
  the ``Budgets`` they read and the ``POLICIES`` registry;
- ``plan``: ``build_plan`` -> ``Plan(table, summary)``, one epoch, identical on every rank;
- ``dealing``: how batches are dealt to (step, rank) slots (balanced: sort-and-chunk);
- ``sampler``: ``PlanBatchSampler``, a ``torch.utils.data`` batch sampler over a plan;
- ``simulate``: the plan through a cost model -> per-step table and metrics (``model``);
- ``paper_map``: the grid of the paper's unpublished choices, planned and simulated.

In your own trainer (docs/sampler.md has runnable examples for PyTorch, DDP and Accelerate)::

    from torch.utils.data import DataLoader

    from adaptiveload.costmodel import Calibration
    from adaptiveload.data.dataset import LatentDataset
    from adaptiveload.data.manifest import load_manifest
    from adaptiveload.planning.policies import Budgets
    from adaptiveload.planning.sampler import PlanBatchSampler

    budgets = Budgets.resolve(calibration=Calibration.load("h200-wan2.1-t2v-1.3b.json"))
    sampler = PlanBatchSampler.from_manifest(load_manifest("manifest.csv"), "adaptiveload",
                                             budgets, world_size, rank, seed)
    loader = DataLoader(LatentDataset(sampler.samples), batch_sampler=sampler)

(Submodules are imported explicitly so that planning without torch stays torch-free.)
"""
