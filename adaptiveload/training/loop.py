"""The training loop: one code path for emulated and distributed ranks.

Per step, every rank this process runs (all N when emulated, its own when distributed) takes
its micro-batch from its PlanBatchSampler (collated by `data.packed.collate`, fed to the model
dense or as shape groups of one token stream by the run's `Execution`, docs/packing.md), runs
forward+backward with its loss scaled so that the step's gradient is the mean over ALL
samples of the step (docs/definitions.md, loss weighting):

    loss_r = sum_{i in r} l_i / G * k,   G = samples of the step over all ranks,

k = N under DDP/FSDP (which average over ranks) and k = 1 when emulated (gradients of the N
micro-batches accumulate). A micro-batch the plan puts on a sequence-parallel group of d
ranks (`sp_plan`, docs/sequence_parallel.md) is loaded by each of them, runs with the
group's `sp_group`, draws the noise of its number in the step on all of them, and counts
its samples once in G: each rank's gradients are its tokens' share and the world's mean is
still the step's mean over its samples (torchrun only: emulated ranks refuse groups). Then
one clipped AdamW step. Each micro-batch is timed on its own by the run's timer
(`distributed.timer_of`: CUDA events on GPU; on CPU the computing thread's CPU time when
ranks are emulated, the wall clock under torchrun) and, beside it, by the wall clock; the
rows of the per-step table are produced (with groups, each rank's row carries its group's
degree and a group's samples count on its first rank's row only).

Micro-batches come through the reader (`training.reader`): each rank's next ones are
fetched ahead in plan order by background worker processes while the model computes; load_r below
is the exposed load, the part of the load the step waited for (`load_exposed_s`; the whole
load is `load_s`).

Emulated step time (what the N ranks would take in parallel, minus communication), once per
clock (`step_time_s` by the timer, `step_wall_s` by the wall clock):
    step_time_s = max_r (load_r + compute_r) + optimizer_s
    wait_r      = max_r' compute_r' - compute_r
Communication is left out on both clocks: one process has no all-reduce to time.
Distributed step time is the measured wall of the step, the slowest process's.

Emulated on a CPU, torch runs ONE intra-op thread for the whole run (restored by `close`):
every timed span is then one thread's work, which its thread CPU time counts exactly, and two
runs side by side on a 2-core machine do not fight over cores.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration
from adaptiveload.data.dataset import LatentDataset
from adaptiveload.errors import UserError
from adaptiveload.experiment import SCRATCH
from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import WanModel
from adaptiveload.planning.sampler import PlanBatch, PlanBatchSampler, PlanBuilder
from adaptiveload.progress import progress_bar
from adaptiveload.step_table import (
    LOAD_COLUMNS,
    REFINE_COLUMNS,
    SP_DEGREE,
    STEP_COLUMNS,
    VAL_COLUMNS,
    WARMUP_KEY,
    WHOLE_EPOCH,
    run_steps,
    timed,
)
from adaptiveload.training import checkpoint, finetune
from adaptiveload.training import distributed as dd
from adaptiveload.training.objective import per_sample_loss, step_generator
from adaptiveload.training.reader import PlanFeed, make_reader
from adaptiveload.training.refine import ClosedLoop
from adaptiveload.training.settings import TrainConfig
from adaptiveload.training.sp_groups import SPGroups
from adaptiveload.training.sp_plan import Placement, PlanGroups, check_groups
from adaptiveload.training.validation import Validator

# per-rank MLflow metrics of every step (`rank{r}/<column>`): the rank's compute time and what
# its micro-batch held, n (a pack's segments), Σ S and Σ S² (what its cost depends on); and,
# in a run of sequence-parallel groups, its group's degree (`rank{r}/sp_degree`)
RANK_METRICS = ("compute_s", "samples", "tokens", "tokens_sq")


class StepSink(Protocol):
    """Where per-step metrics go besides the table (the MLflow tracker implements it)."""

    def log_step(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...


@dataclass
class TrainData:
    """The plan source and the dataset it indexes (dataset order == builder.samples order)."""

    builder: PlanBuilder
    dataset: LatentDataset
    calibration: Calibration | None = None
    validation: Validator | None = None  # the held-out set (train.val_every > 0)


@dataclass
class TrainResult:
    steps: pd.DataFrame  # one row per (step, rank), STEP_COLUMNS


@dataclass(frozen=True)
class Loaded:
    """One rank's micro-batch on the device: its plan indices, where it runs (its group, its
    number in the step, the step's sample count), the model's input in the run's layout, the
    text context, and how long loading took: the part the step waited for (run's timer,
    wall clock) and the whole load (`whole_load_s`, the run's timer where each part ran)."""

    indices: PlanBatch
    place: Placement
    x0: Any  # a dense tensor or the packed shape groups (`Execution.layout`)
    context: torch.Tensor
    load_s: float
    load_wall_s: float
    whole_load_s: float = 0.0

    @property
    def inputs(self) -> tuple[Any, torch.Tensor]:
        return self.x0, self.context


@dataclass(frozen=True)
class Ran:
    """One micro-batch's forward and backward: its loss summed over its samples, its compute
    time (run's timer; under DDP until its gradients are ready), wall time and wait."""

    loss_sum: float
    compute_s: float
    compute_wall_s: float
    wait_s: float


@dataclass(frozen=True)
class MicroBatchTiming:
    """A measured micro-batch: its row of the per-step table (the columns of STEP_COLUMNS it
    knows; `Trainer._step` adds the step-wide ones) and the load times that the emulated step
    time adds, which are no column."""

    row: dict[str, Any]
    load_s: float  # the run's timer
    load_wall_s: float  # the wall clock


def build_model(cfg: TrainConfig, device: torch.device) -> WanModel:
    """Wan 2.1 with seeded init, or the checkpoint of `model.init_from`: every launch mode on
    one kind of device starts from the same weights; with `train.lora`, seeded adapters on
    it (`finetune`). Built on `device` itself: the 1.4B parameters of the 1.3B take tens of
    seconds to initialize on a CPU, under one on a GPU (where every process of the same seed
    draws the same weights, and DDP broadcasts rank 0's anyway)."""
    torch.manual_seed(cfg.seed)
    if cfg.init_from != SCRATCH:
        model = finetune.load_pretrained(
            cfg.init_from, cfg.model, cfg.kernel, cfg.activation_checkpointing
        )
        model.execution = cfg.execution
    else:
        with device:
            model = WanModel(
                get_config(cfg.model),
                ln_modulate_impl=cfg.kernel,
                activation_checkpointing=cfg.activation_checkpointing,
                execution=cfg.execution,
            )
    return finetune.prepare(model.to(device), cfg.lora, cfg.init_from)


def step_metrics(
    rows: list[dict[str, Any]], capacity: float | None, warmup_steps: int = 0
) -> dict[str, float]:
    """The per-step MLflow metrics of one step's rows of the per-step table (one per rank),
    under their stable keys: computed from the table's columns alone, so a step re-logged
    from a checkpoint's rows gets the values it had when it was measured. `loss` is the
    step's mean over its samples; throughput counts real samples (`padding_samples` beside);
    `vram_utilization` needs the device's `capacity` (CUDA); `warmup` is 1.0 on the run's
    first `warmup_steps` steps, which no summary counts, else 0.0."""
    t = np.array([[row["compute_s"] for row in rows]])
    step_time = rows[0]["step_time_s"]
    samples = sum(row["samples"] for row in rows)
    padding = sum(row["padding_samples"] for row in rows)
    out = {
        # a group's loss once, from its first rank's row (its other rows count no samples)
        "loss": sum(row["loss"] * row["samples"] for row in rows if row["samples"]) / samples,
        "step_time_s": step_time,
        "step_wall_s": rows[0]["step_wall_s"],
        "imbalance_rate": metrics.imbalance_rate(t),
        "idle_fraction": metrics.idle_fraction(t),
        WARMUP_KEY: float(not timed(rows[0]["step"], warmup_steps)),
    }
    real_tokens = sum(row["tokens"] - row["padding_tokens"] for row in rows)
    out["samples_per_s"], out["tokens_per_s"] = metrics.throughput(
        samples - padding, real_tokens, step_time
    )
    out["padding_samples"] = padding
    out["samples_seen"] = rows[0]["samples_seen"]
    out.update({k: rows[0][k] for k in VAL_COLUMNS if _present(rows[0][k])})
    if capacity:
        peaks = np.array([[row["peak_bytes"] for row in rows]])
        out["vram_utilization"] = metrics.vram_utilization(peaks, capacity)[0]
    for row in rows:
        out.update({f"rank{row['rank']}/{k}": row[k] for k in RANK_METRICS})
        if SP_DEGREE in row:
            out[f"rank{row['rank']}/{SP_DEGREE}"] = row[SP_DEGREE]
    if _present(rows[0].get("refit")):  # a closed-loop window's end (training.refine)
        out.update({f"refine/{k}": rows[0][k] for k in REFINE_COLUMNS if k != "speed_factor"})
        out.update({f"rank{row['rank']}/speed_factor": row["speed_factor"] for row in rows})
    return out


def _present(value: Any) -> bool:
    """A value the row holds: not None, NA or NaN (a restored table's empty cells are NA)."""
    return value is not None and not pd.isna(value)


def epoch_lengths(cfg: TrainConfig, data: TrainData) -> list[int]:
    """With `steps: epoch`, the step count of each of the run's `train.epochs` plans (empty
    for a run of a fixed step count)."""
    if cfg.steps != WHOLE_EPOCH:
        return []
    return [epoch_length(data, e) for e in range(cfg.epochs)]


def epoch_length(data: TrainData, epoch: int) -> int:
    """The optimizer steps of `epoch`'s plan."""
    return int(data.builder(epoch).table["step"].max()) + 1


def total_steps(cfg: TrainConfig, data: TrainData) -> int:
    """The steps of a run: `train.steps`, or with `steps: epoch` the warm-up plus all steps of
    its epochs."""
    return run_steps(cfg.steps, cfg.warmup_steps, sum(epoch_lengths(cfg, data)))


class Trainer:
    """Holds the model, optimizer and per-rank samplers of one run; `run()` trains it."""

    def __init__(
        self,
        cfg: TrainConfig,
        data: TrainData,
        ckpt_dir: Path | None,
        ranks: dd.Ranks,
        sink: StepSink | None = None,
        resume: dict[str, Any] | None = None,
        progress: bool = True,
        identity: str | None = None,
    ):
        self.cfg, self.data, self.sink = cfg, data, sink
        # what a checkpoint must match to be resumed (inputs.run_identity; the config alone
        # when the caller has no data identity)
        self.identity = identity or cfg.fingerprint()
        # None: no checkpoints (short measurement runs; the 1.3B's state is 16 GB per save)
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
        self.progress = progress
        self.ranks, self.device = ranks, dd.setup(ranks, cfg.device)
        if self.ranks.world_size != data.builder.world_size:
            raise ValueError(
                f"plan is for {data.builder.world_size} ranks, launch has {self.ranks.world_size}"
            )
        # train.refine: the plans follow the run's refits (None: the builder's, as planned)
        self.closed_loop = ClosedLoop.of(cfg, data.builder)
        self.source = self.closed_loop.plans if self.closed_loop else data.builder
        # each epoch's sequence-parallel groups: every micro-batch's number in its step
        self.plans = PlanGroups(self.source, data.builder.world_size)
        check_groups(data.builder(0).table, cfg, ranks.distributed, "plan")
        self.timer = dd.timer_of(cfg.launch_mode, cfg.device)
        self.clock = dd.Clock(self.device, self.timer)
        self._threads_before = torch.get_num_threads()
        if self.timer == dd.THREAD_TIME:
            torch.set_num_threads(1)
        model = build_model(cfg, self.device)
        self.dtype = next(model.parameters()).dtype
        self.model = dd.wrap(model, self.ranks, self.device, cfg.fsdp, cfg.autocast_dtype)
        self.optimizer = torch.optim.AdamW(
            finetune.trainable(self.model),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
        )
        # fp16 gradients underflow without loss scaling; disabled, the scaler passes through
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self.samplers = {r: PlanBatchSampler(self.source, r) for r in self.ranks.local}
        if self.ranks.distributed:  # processes that read their inputs differently stop here
            next(iter(self.samplers.values())).check_ranks()
        self.sp, self.columns = self._sp_groups()
        if self.closed_loop:
            self.columns = (*self.columns, *REFINE_COLUMNS)
        self._tokens = data.builder.samples["tokens"].to_numpy(np.int64)  # per dataset index
        self.rows: list[dict[str, Any]] = []
        self.start_step = 0
        if resume is not None:
            self._restore(resume)
        self._iters = {r: iter(s) for r, s in self.samplers.items()}
        # each rank's next micro-batches, fetched ahead in plan order (training/reader.py)
        clock = time.thread_time if self.timer == dd.THREAD_TIME else time.perf_counter
        reader = make_reader(data.dataset, cfg.reader_workers, clock)
        self.feed = PlanFeed(reader, self.source, self.samplers, cfg.prefetch_depth)
        lengths = epoch_lengths(cfg, data)
        self.total_steps = run_steps(cfg.steps, cfg.warmup_steps, sum(lengths))
        self.epoch_ends = self._epoch_ends(lengths) if data.validation else set()
        self.seen = int(self.rows[-1]["samples_seen"]) if self.rows else 0
        self.grad_clock = (
            dd.GradReadyClock(self.model, self.device) if self.ranks.distributed else None
        )
        self.capacity = (
            torch.cuda.get_device_properties(self.device).total_memory
            if self.device.type == "cuda"
            else None
        )

    def _sp_groups(self) -> tuple[SPGroups | None, tuple[str, ...]]:
        """The run's sequence-parallel groups, built once on every process (None: the plan
        has none, or the ranks are emulated, which `check_groups` let through only without
        groups), and the per-step table's columns (with `SP_DEGREE` where the plan may have
        some): of every degree of epoch 0's plan and every power of two up to the policy's
        largest (its summary's ``sp_max_degree``, where it gives one), so later epochs find
        theirs."""
        plan = self.data.builder(0)
        largest = int(plan.summary.get("sp_max_degree") or 1)
        degrees = {*self.plans.degrees(0), *(1 << k for k in range(1, largest.bit_length()))}
        if not degrees:
            return None, (*STEP_COLUMNS, *LOAD_COLUMNS)
        columns = (*STEP_COLUMNS, *LOAD_COLUMNS, SP_DEGREE)
        if not self.ranks.distributed:
            return None, columns
        return SPGroups.build(self.ranks.world_size, degrees), columns

    def _group(self, rank: int, place: Placement) -> Any:
        """The process group `rank`'s micro-batch runs over (None: the rank alone). A group
        where the run built none (a later epoch's plan, emulated ranks) is refused: running
        its pack unsharded on each of its ranks would train it d times."""
        if place.degree == 1:
            return None
        if self.sp is None:
            fix = (f"launch with torchrun --nproc-per-node {self.ranks.world_size}"
                   if not self.ranks.distributed else
                   "the policy's plan summary must give sp_max_degree")
            raise UserError(
                f"plan: a micro-batch of sequence-parallel degree {place.degree} (first rank "
                f"{place.first}) after an epoch 0 without groups, and this run built none "
                f"from it; {fix}"
            )
        return self.sp.group_of(rank, place.degree)[0]

    def _epoch_ends(self, lengths: list[int]) -> set[int]:
        """The run steps that end an epoch (validation follows each): after a replayed warm-up
        the whole epochs' own; in a run of a fixed step count, the plan's epochs in turn."""
        if self.cfg.steps == WHOLE_EPOCH:
            return {self.cfg.warmup_steps + int(end) - 1 for end in np.cumsum(lengths)}
        ends, done, epoch = set(), 0, 0
        while done < self.total_steps:
            done += epoch_length(self.data, epoch)
            ends.add(done - 1)
            epoch += 1
        return ends

    # -- checkpoint ---------------------------------------------------------------------------
    def _restore(self, state: dict[str, Any]) -> None:
        if state["identity"] != self.identity:
            raise UserError(f"{state['path']}: checkpoint of another run identity")
        if self.cfg.lora is None:
            dd.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:  # the adapters over the base this run rebuilt (finetune module docstring)
            finetune.restore_state(dd.unwrap(self.model), state["model"], state["path"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.closed_loop:  # the refits first: the samplers resume in the refitted plans
            self.closed_loop.load_state_dict(state["closed_loop"])
        for r, sampler in self.samplers.items():
            sampler.load_state_dict(state["samplers"][r])
        checkpoint.set_rng_state(state["rng"])
        self.rows = list(state["rows"])
        self.start_step = int(state["step"])

    def _save(self, done: int) -> None:
        model_sd, optim_sd = dd.full_state(self.model, self.optimizer)
        samplers: dict[int, Any] = {}
        for part in dd.all_gather(
            {r: s.state_dict() for r, s in self.samplers.items()}, self.ranks
        ):
            samplers.update(part)
        if self.ranks.is_main:
            checkpoint.save(
                self.ckpt_dir,
                done,
                {
                    "identity": self.identity,
                    "config": self.cfg.to_dict(),
                    "model": finetune.saved_state(model_sd, self.cfg.lora),
                    "optimizer": optim_sd,
                    "samplers": samplers,
                    "rows": self.rows,
                    "closed_loop": self.closed_loop.state_dict() if self.closed_loop else None,
                    "tracking": self.sink.state_dict() if self.sink else {},
                },
            )
        dd.barrier(self.ranks)

    # -- one step -------------------------------------------------------------------------------
    def _next_batch(self, rank: int) -> PlanBatch:
        """`rank`'s next micro-batch: its dataset indices and `info` (the samples of the whole
        step, whether it is a padding repeat)."""
        sampler = self.samplers[rank]
        try:
            batch = next(self._iters[rank])
        except StopIteration:  # epoch over: the next epoch's plan, from its first step
            sampler.set_epoch(sampler.epoch + 1)
            self._iters[rank] = iter(sampler)
            batch = next(self._iters[rank])
        return batch

    def _autocast(self):
        """Forward and backward in the run's `train.precision` (fp32: no autocast)."""
        dtype = self.cfg.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext()

    def _load(self, rank: int) -> Loaded:
        """`rank`'s next micro-batch on the device, in the run's layout, through the reader.
        Exposed load: the loop's own time in loading plus the wall time it blocked for a
        worker still fetching; the whole load: the loop's own time plus the worker's."""
        w0, t0 = self.clock.both()
        indices = self._next_batch(rank)
        place = self.plans.at(indices.info, rank)
        fetched = self.feed.load(rank, indices)
        batch = fetched.batch.to(self.device, self.dtype)
        x0 = batch.inputs(self.cfg.execution.packed)
        w1, t1 = self.clock.both()
        blocked = fetched.blocked_s  # wall; the thread's CPU time does not count a wait
        own = t1 - t0 if self.timer == dd.THREAD_TIME else t1 - t0 - blocked
        return Loaded(indices, place, x0, batch.context, load_s=own + blocked,
                      load_wall_s=w1 - w0, whole_load_s=own + fetched.fetch_s)

    def _run(self, step: int, rank: int, loaded: Loaded) -> Ran:
        """Forward and backward of one micro-batch, its loss scaled for the step's mean
        (module docstring), timed by the run's timer and the wall clock. On a
        sequence-parallel group every rank runs the same samples with the same noise (drawn
        for the micro-batch's number in the step) and the same scale, G counting each sample
        once: each rank's gradients are its tokens' share, summed over the group the
        micro-batch's (docs/sequence_parallel.md, the reduction contract)."""
        place = loaded.place
        scale = (self.ranks.world_size if self.ranks.distributed else 1) / place.step_samples
        group = self._group(rank, place)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.grad_clock:
            self.grad_clock.reset()
        w0, t0 = self.clock.both()
        start: Any = w0
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        gen = step_generator(self.cfg.seed, step, place.index)
        with self._autocast():
            losses = per_sample_loss(
                self.model, *loaded.inputs, self.cfg.objective, gen, sp_group=group
            )
        self.scaler.scale(losses.sum() * scale).backward()
        if cuda:
            end.record()
            end.synchronize()
        w1, t1 = self.clock.both()
        fwd_bwd = start.elapsed_time(end) / 1000.0 if cuda else t1 - t0
        compute, wait = fwd_bwd, 0.0
        if self.ranks.distributed:
            ready = self.grad_clock.elapsed_since(start) if self.grad_clock else None
            if ready is not None:
                compute, wait = ready, max(fwd_bwd - ready, 0.0)
            else:  # FSDP2: gradients are reduce-scattered outside the hooks' view
                t_b = self.clock.now()
                dd.barrier(self.ranks)
                wait = self.clock.now() - t_b
        loss_sum = float(losses.detach().sum())
        return Ran(loss_sum=loss_sum, compute_s=compute, compute_wall_s=w1 - w0, wait_s=wait)

    def _measure(self, step: int, rank: int, loaded: Loaded, ran: Ran) -> MicroBatchTiming:
        """The micro-batch's row of the per-step table (its step-wide columns follow in
        `_step`) and the load times the emulated step time adds."""
        indices = loaded.indices
        tokens = self._tokens[indices]
        b = len(indices)
        # a cell of several shapes is reported by its largest sample's bucket shape
        frames, height, width = self.data.dataset.shapes[indices[int(np.argmax(tokens))]]
        cuda = self.device.type == "cuda"
        padding = indices.info.is_padding
        place = loaded.place
        # a rank's bytes at its group's degree (`CostModel.at_degree`), as the simulator's
        cal = self.data.calibration
        model_bytes = cal.cost.at_degree(place.degree).set_memory(tokens) if cal else None
        row = {
            "step": step,
            "rank": rank,
            "compute_s": ran.compute_s,
            "compute_wall_s": ran.compute_wall_s,
            "wait_s": ran.wait_s,
            "samples": b,
            "tokens": int(tokens.sum()),
            "tokens_sq": int((tokens * tokens).sum()),
            "frames": int(frames),
            "height": int(height),
            "width": int(width),
            "peak_bytes": float(torch.cuda.max_memory_allocated(self.device)) if cuda else None,
            "peak_bytes_model": model_bytes,
            "loss": ran.loss_sum / b,  # the table keeps the mean over the samples
            "lower_bound_s": None,  # a simulation's column: no model number in a measured row
            # a padding repeat trains (its gradient counts) but is no new data: not throughput
            "padding_samples": b if padding else 0,
            "padding_tokens": int(tokens.sum()) if padding else 0,
            SP_DEGREE: place.degree,
            LOAD_COLUMNS[0]: loaded.whole_load_s,
            LOAD_COLUMNS[1]: loaded.load_s,
        }
        if not place.leads(rank):  # a group's samples count once, on its first rank's row
            row.update(samples=0, tokens=0, tokens_sq=0, frames=0, height=0, width=0,
                       loss=None, padding_samples=0, padding_tokens=0)
        return MicroBatchTiming(row, load_s=loaded.load_s, load_wall_s=loaded.load_wall_s)

    def _micro_batch(self, step: int, rank: int) -> MicroBatchTiming:
        loaded = self._load(rank)
        return self._measure(step, rank, loaded, self._run(step, rank, loaded))

    def forward_backward(self, step: int) -> list[MicroBatchTiming]:
        """Every local rank's micro-batch of `step`: gradients accumulated, timings returned."""
        self.optimizer.zero_grad(set_to_none=True)
        return [self._micro_batch(step, r) for r in self.ranks.local]

    def optimizer_step(self, step: int) -> None:
        self.scaler.unscale_(self.optimizer)  # clip the true gradients
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.optim.lr_at(step, self.total_steps)
        self.scaler.step(self.optimizer)  # skips a step of non-finite fp16 gradients
        self.scaler.update()

    def _step(self, step: int) -> list[dict[str, Any]]:
        t_step = self.clock.now()
        local = self.forward_backward(step)
        w_opt, t_opt = self.clock.both()
        self.optimizer_step(step)
        w_end, t_end = self.clock.both()
        if self.ranks.distributed:  # the step's wall on each process, the slowest counts
            parts = dd.all_gather((w_end - t_step, [m.row for m in local]), self.ranks)
            rows = [row for _, part in parts for row in part]
            step_time = step_wall = max(wall for wall, _ in parts)
        else:
            rows = [m.row for m in local]
            compute_max = max(row["compute_s"] for row in rows)
            for row in rows:
                row["wait_s"] = compute_max - row["compute_s"]
            step_time = max(m.load_s + m.row["compute_s"] for m in local) + (t_end - t_opt)
            step_wall = max(m.load_wall_s + m.row["compute_wall_s"] for m in local) + (
                w_end - w_opt
            )
        self.seen += sum(row["samples"] - row["padding_samples"] for row in rows)
        load = os.getloadavg()[0]
        for row in rows:
            row["host_load_1m"] = load
            row["step_time_s"] = step_time
            row["step_wall_s"] = step_wall
            row["samples_seen"] = self.seen
            row.update(dict.fromkeys(VAL_COLUMNS))
            row.update(dict.fromkeys(REFINE_COLUMNS))  # the closed loop's, at a window's end
        return [{k: row[k] for k in self.columns} for row in sorted(rows, key=lambda r: r["rank"])]

    # -- the run -------------------------------------------------------------------------------
    def _replay_epoch(self) -> None:
        """`steps: epoch`: the warm-up is over, so every rank starts epoch 0 again from its first
        step; the timed window is then exactly one whole epoch (the warm-up's batches twice)."""
        for r, sampler in self.samplers.items():
            sampler.set_epoch(0, step=0)  # from step 0 even right after a resume
            self._iters[r] = iter(sampler)

    def _relog_restored(self) -> None:
        """Hand the sink every step the checkpoint restored, as the table holds them: the sink
        skips what its store already has, and a run that continues in a new MLflow run (the
        store held the stopped process's timings of later steps) gets them all, so MLflow
        and the per-step table agree after any resume."""
        if self.sink is None or not self.ranks.is_main or not self.rows:
            return
        by_step: dict[int, list[dict[str, Any]]] = {}
        for row in self.rows:
            by_step.setdefault(int(row["step"]), []).append(row)
        for step in sorted(by_step):
            self.sink.log_step(
                step, step_metrics(by_step[step], self.capacity, self.cfg.warmup_steps)
            )

    def _validate(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Score the held-out set after `step`'s update into its rows (`VAL_COLUMNS`): after
        the first step, every `val_every` steps and at each epoch's end; outside the step's
        timed spans, so no step time includes it."""
        if self.data.validation is None:  # train.val_every: 0
            return
        due = step == 0 or (step + 1) % self.cfg.val_every == 0 or step in self.epoch_ends
        if not due:
            return
        scores = self.data.validation.score(
            self.model, self.ranks, self.device, self._autocast, self.cfg.execution.packed
        )
        for row in rows:
            row.update(scores)

    def _refine(self, step: int, rows: list[dict[str, Any]], bar: Any) -> None:
        """train.refine: the step's rows to the closed loop, which at a window's end refits,
        replans the samplers and writes the window on `rows` (training.refine)."""
        if self.closed_loop is None:
            return
        note = self.closed_loop.after_step(step, rows, list(self.samplers.values()))
        if note is None:
            return
        self.plans = PlanGroups(self.source, self.ranks.world_size)  # the replanned groups
        if self.progress and self.ranks.is_main:
            bar.write(note, file=sys.stderr)

    def run(self) -> TrainResult:
        cfg = self.cfg
        self._relog_restored()
        bar = progress_bar(
            total=self.total_steps,
            initial=self.start_step,
            desc=f"train {cfg.run_name}",
            disable=not (self.progress and self.ranks.is_main),
        )
        try:
            for step in range(self.start_step, self.total_steps):
                if cfg.steps == WHOLE_EPOCH and step == cfg.warmup_steps:
                    self._replay_epoch()
                rows = self._step(step)
                self._refine(step, rows, bar)
                self._validate(step, rows)
                logged = step_metrics(rows, self.capacity, cfg.warmup_steps)
                if not math.isfinite(logged["loss"]):  # every later step would be NaN too
                    raise UserError(
                        f"step {step}: the loss is {logged['loss']} (the model diverged); "
                        f"lower train.lr (now {cfg.optim.lr:g}) or train.grad_clip, or check the "
                        "inputs for NaN or infinite values"
                    )
                self.rows.extend(rows)
                if self.ranks.is_main and self.sink is not None:
                    self.sink.log_step(step, logged)
                done = step + 1
                if self.ckpt_dir is not None and (
                    done % cfg.checkpoint_every == 0 or done == self.total_steps
                ):
                    self._save(done)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{logged['loss']:.4f}",
                    tok_s=f"{logged['tokens_per_s']:.0f}",
                    refresh=False,
                )
        finally:
            bar.close()
            self.feed.close()
            if self.grad_clock:
                self.grad_clock.remove()
        table = pd.DataFrame(self.rows, columns=list(self.columns))
        refine = REFINE_COLUMNS if self.closed_loop else ()
        for col in ("peak_bytes", "peak_bytes_model", "loss", *VAL_COLUMNS, *refine):
            table[col] = table[col].astype("Float64")
        return TrainResult(steps=table)

    def close(self) -> None:
        self.feed.close()
        torch.set_num_threads(self._threads_before)
        dd.teardown(self.ranks)
