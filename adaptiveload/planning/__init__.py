"""Batch planning: which samples form each micro-batch, and which rank runs it in which step.

- ``budgets``: the ``Budgets`` every policy reads (``Budgets.resolve``: from a calibration);
- ``policies``: B(S) rules (``equal-token``, ``adaptiveload``, ``adaptiveload-balanced``,
  ``adaptiveload-packed``), each forming and dealing its own micro-batches
  (``Policy.micro_batches``), and the ``POLICIES`` registry;
- ``batches``: what a policy forms micro-batches from and hands back; the bucket cuts;
- ``baselines``: the field's own ways of forming micro-batches (token-count packing, verl's
  Karmarkar-Karp, KnapFormer's greedy bags), the ``peer`` policies' (docs/baselines.md);
- ``plan``: ``PlanConfig`` (what a plan is made from) and ``build_plan`` ->
  ``Plan(table, summary)``, one epoch, identical on every rank;
- ``dealing``: how batches are dealt to (step, rank) slots (balanced: sort-and-chunk);
- ``sampler``: ``PlanBatchSampler``, a ``torch.utils.data`` batch sampler over a plan, whose
  batches carry a ``BatchInfo`` (step, padding, the step's samples);
- ``compare``: every policy's plan of one manifest through one cost model (``adaptiveload
  compare``);
- ``simulate``: the plan through a cost model -> per-step table and metrics (``model``);
- ``paper_map``: the grid of the paper's unpublished choices, planned and simulated.

In your own trainer (docs/sampler.md has runnable examples for PyTorch, gradient accumulation,
DDP, Accelerate, Lightning and diffusers' WanTransformer3DModel)::

    from torch.utils.data import DataLoader

    from adaptiveload.costmodel import Calibration
    from adaptiveload.data.dataset import LatentDataset
    from adaptiveload.data.manifest import load_manifest
    from adaptiveload.planning.policies import Budgets
    from adaptiveload.planning.sampler import BatchInfoDataset, PlanBatchSampler

    budgets = Budgets.resolve(calibration=Calibration.load("h200-wan2.1-t2v-1.3b"))
    sampler = PlanBatchSampler.from_manifest(load_manifest("manifest.csv"), "adaptiveload",
                                             budgets, world_size, rank, seed)
    data = BatchInfoDataset(LatentDataset(sampler.samples))
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=data.collate)
    for batch, info in loader:  # info.step, info.step_samples, info.is_padding
        ...

(Submodules are imported explicitly so that planning without torch stays torch-free.)
"""
