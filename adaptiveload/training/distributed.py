"""Which ranks this process runs, and the data-parallel wrapping of the model.

Two launch modes, one loop:

- **distributed**: one process per rank under `torchrun` (or SLURM's srun with the torchrun
  env vars). gloo on CPU, NCCL on CUDA; each process takes the GPU of its `LOCAL_RANK`.
  `ADAPTIVELOAD_DIST_BACKEND=gloo` keeps gloo on CUDA too, which lets several processes share
  one GPU (NCCL refuses two ranks on one device): a check of the multi-process CUDA path on a
  single GPU, not a measurement. The model is wrapped in DDP (gradients all-reduced
  in buckets during backward, overlapping communication with compute), or sharded with FSDP2
  `fully_shard` per block (`train.fsdp`, meant for the 14B config: parameters, gradients and
  optimizer state sharded, parameters gathered in `train.precision`, fp32 reduction).
- **emulated**: one process plays all N ranks in turn on one device; no process group.

Timing in distributed mode: a rank's compute time ends when its last parameter gradient is
accumulated (a post-accumulate-grad hook on every parameter), and its wait time runs from
there to the end of backward, which DDP holds until the bucketed all-reduce (and so the
slowest rank) has finished. With FSDP2 the gradient hooks do not see sharded gradients; there
compute time is the whole forward+backward and wait is the explicit barrier after it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from adaptiveload.errors import UserError
from adaptiveload.pipeline import check_world_size


@dataclass(frozen=True)
class Ranks:
    """How this process was launched: the plan's ranks and the subset this process runs.

    Made once per run by `resolve_ranks` and passed down; the run's `launch_mode` and
    `world_size` (TrainConfig, summary, MLflow tags) are this object's."""

    world_size: int
    local: tuple[int, ...]
    distributed: bool
    process_rank: int = 0
    local_rank: int = 0  # the GPU of this process on its node (torchrun's LOCAL_RANK)

    @classmethod
    def emulated(cls, world_size: int) -> Ranks:
        """One process running all `world_size` ranks in turn."""
        return cls(world_size, tuple(range(world_size)), False)

    @property
    def launch_mode(self) -> str:
        return "distributed" if self.distributed else "emulated"

    @property
    def is_main(self) -> bool:
        return self.process_rank == 0


def resolve_ranks(emulate_world_size: int | None, world_size: int) -> Ranks:
    """The run's ranks: the one reader of torchrun's RANK, WORLD_SIZE and LOCAL_RANK.

    Under torchrun (or srun with its variables) each process is one rank of WORLD_SIZE.
    Otherwise one process emulates `emulate_world_size` ranks (--emulate-world-size), else
    `world_size` (the experiment's train.world_size).
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if emulate_world_size is not None:
            raise UserError("--emulate-world-size: not with torchrun (one process per rank there)")
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        return Ranks(size, (rank,), True, rank, int(env.get("LOCAL_RANK", 0)))
    if emulate_world_size is None:
        return Ranks.emulated(world_size)
    return Ranks.emulated(check_world_size(emulate_world_size, "--emulate-world-size"))


BACKEND_ENV = "ADAPTIVELOAD_DIST_BACKEND"


def backend(device: str) -> str:
    """The process-group backend: $ADAPTIVELOAD_DIST_BACKEND, else NCCL on CUDA, gloo on CPU."""
    name = os.environ.get(BACKEND_ENV) or ("nccl" if device == "cuda" else "gloo")
    if name not in ("nccl", "gloo") or (name == "nccl" and device != "cuda"):
        raise UserError(f"{BACKEND_ENV}={name}: expected gloo, or nccl with device cuda")
    return name


def setup(ranks: Ranks, device: str) -> torch.device:
    """Start the process group (distributed) and pick this process's device."""
    if not ranks.distributed:
        if device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    name = backend(device)
    dev = torch.device("cpu")
    if device == "cuda":
        local, gpus = ranks.local_rank, torch.cuda.device_count()
        if gpus == 0:
            raise UserError("device cuda: no CUDA GPU is visible to this process")
        if local >= gpus and name == "nccl":
            raise UserError(
                f"LOCAL_RANK {local}: this node has {gpus} GPU(s) and NCCL needs one per "
                f"process; start at most {gpus} processes per node, or set {BACKEND_ENV}=gloo "
                "to share GPUs (a functional check, not a measurement)"
            )
        dev = torch.device("cuda", local % gpus)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=name, device_id=dev if name == "nccl" else None)
    return dev


def teardown(ranks: Ranks) -> None:
    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(
    model: nn.Module, ranks: Ranks, device: torch.device, fsdp: bool, dtype: torch.dtype | None
) -> nn.Module:
    """DDP or FSDP2 around `model` in distributed mode; the bare model when emulated. FSDP2
    gathers parameters in the run's autocast `dtype` (None: fp32) and reduces in fp32."""
    if not ranks.distributed:
        return model
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy()
        if dtype is not None:
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in getattr(model, "blocks", []):
            fully_shard(block, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state dicts (on CPU for FSDP2)."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(model, optimizer, options=opts)
    return unwrap(model).state_dict(), optimizer.state_dict()


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True)
        set_state_dict(
            model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts
        )
        return
    unwrap(model).load_state_dict(model_sd)
    optimizer.load_state_dict(optim_sd)


def all_gather(obj: Any, ranks: Ranks) -> list[Any]:
    """Every process's `obj`, in rank order (just [obj] when emulated)."""
    if not ranks.distributed:
        return [obj]
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        dist.barrier()


WALL, THREAD_TIME, CUDA_EVENTS = "wall", "cpu thread time", "cuda events"


def timer_of(launch_mode: str, device: str) -> str:
    """The clock that times a run's per-rank compute, named as labels and MLflow show it.

    CUDA: events on the compute stream. Emulated ranks on a CPU: the CPU time of the one
    thread that computes (`time.thread_time`, torch limited to one intra-op thread), which
    counts the work and not the time spent waiting for a core, so other processes on the
    machine do not land in some ranks' times and not others'. Distributed ranks on a CPU keep
    the wall clock: their waiting for each other is part of what is measured.
    """
    if device == "cuda":
        return CUDA_EVENTS
    return THREAD_TIME if launch_mode == "emulated" else WALL


class Clock:
    """Device-synchronised wall clock (CUDA work is finished before a time is read), and the
    calling thread's CPU time when the run's timer is THREAD_TIME."""

    def __init__(self, device: torch.device, timer: str = WALL):
        self.cuda = device.type == "cuda"
        self.thread_time = timer == THREAD_TIME

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def both(self) -> tuple[float, float]:
        """(wall, timer) seconds now; the timer reads the wall clock unless it is thread time."""
        wall = self.now()
        return wall, (time.thread_time() if self.thread_time else wall)


class GradReadyClock:
    """Time at which this rank's backward produced its last parameter gradient.

    Read after backward; None if some parameter received no gradient (unused parameters) or
    hooks do not fire (FSDP2), in which case callers fall back to the end of backward.
    On CUDA the time is taken from an event recorded on the compute stream.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cuda = device.type == "cuda"
        self._count = 0
        self._t: float | None = None
        self._event: torch.cuda.Event | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def _hook(self, _: torch.Tensor) -> None:
        self._count += 1
        if self._count == len(self.params):
            if self.cuda:
                self._event = torch.cuda.Event(enable_timing=True)
                self._event.record()
            else:
                self._t = time.perf_counter()

    def reset(self) -> None:
        self._count, self._t, self._event = 0, None, None

    def elapsed_since(self, start: torch.cuda.Event | float) -> float | None:
        """Seconds from `start` (a perf_counter value, or a CUDA event) to the last gradient."""
        if self._count < len(self.params):
            return None
        if self.cuda:
            assert self._event is not None and isinstance(start, torch.cuda.Event)
            self._event.synchronize()
            return start.elapsed_time(self._event) / 1000.0
        assert self._t is not None
        return self._t - float(start)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
