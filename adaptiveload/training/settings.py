"""The resolved settings of one training run, built from a validated experiment dict.

Grouped like torchtitan's job config (optimizer, objective, run), frozen so that nothing
changes them mid-run; `fingerprint()` is the config's part of a run's identity
(`training.inputs.run_identity`), which a checkpoint must match to be resumed. Defaults are
the experiment schema's (`adaptiveload.experiment.schema_default`), so a field left out of an
experiment file and a field left out of a constructor call agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import torch

from adaptiveload.errors import UserError
from adaptiveload.experiment import SCRATCH, schema_default
from adaptiveload.model.attention import LAYOUTS, Execution
from adaptiveload.model.lora import LoraSpec, lora_spec
from adaptiveload.pipeline import check_world_size
from adaptiveload.planning.policies import get_policy
from adaptiveload.step_table import WHOLE_EPOCH, window_kind
from adaptiveload.training.finetune import checkpoint_digest
from adaptiveload.training.refine import refine_mode

LAUNCH_MODES = ("emulated", "distributed")
KERNELS = ("eager", "fused")
# model.batch_layout: one of the model's LAYOUTS, or auto: packed for a policy that plans
# packs, else dense
AUTO_LAYOUT = "auto"
DEVICES = ("cpu", "cuda")
# train.precision -> the autocast dtype of forward and backward: the one home of the mapping
# (fp32: no autocast); auto resolves to bf16 on CUDA (Wan's), fp32 on CPU
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AUTO_PRECISION = "auto"


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping (Wan's trainers use AdamW, no EMA here) and a
    linear warm-up of the learning rate over the first `lr_warmup_steps` optimizer steps.

    The lr does not scale with the global batch G of a step: each step's gradient is the mean
    over its G samples (docs/definitions.md, loss weighting), so a step of more samples takes
    a step of the same size along a less noisy direction. A policy with fewer, larger steps
    per epoch (packing) therefore moves the weights fewer times per epoch."""

    lr: float = schema_default("train.lr")
    weight_decay: float = schema_default("train.weight_decay")
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = schema_default("train.grad_clip")
    lr_warmup_steps: int = schema_default("train.lr_warmup_steps")
    lr_decay_fraction: float = schema_default("train.lr_decay_fraction")

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of optimizer step `step` (0-based) of a run of `total` steps:
        lr * (step + 1) / (W + 1) during the warm-up of W steps, then lr, and over the last
        D = round(lr_decay_fraction * total) steps lr * (total - step) / (D + 1) (annealing
        the end of a run lowers the step-to-step noise of its loss; the lesser factor where
        the warm-up and the decay overlap)."""
        factor = min(1.0, (step + 1) / (self.lr_warmup_steps + 1))
        decay = round(self.lr_decay_fraction * total)
        if decay and step >= total - decay:
            factor = min(factor, (total - step) / (decay + 1))
        return self.lr * factor


@dataclass(frozen=True)
class ObjectiveConfig:
    """Rectified flow as Wan trains it; see `objective.py` for the formulas."""

    timestep_shift: float = schema_default("train.timestep_shift")
    timestep_sampling: str = schema_default("train.timestep_sampling")  # or "logit-normal"
    logit_mean: float = schema_default("train.logit_mean")
    logit_std: float = schema_default("train.logit_std")
    num_train_timesteps: int = 1000


@dataclass(frozen=True)
class TrainConfig:
    experiment: str
    policy: str
    seed: int
    model: str
    kernel: str = schema_default("model.kernels")[0]
    batch_layout: str = schema_default("model.batch_layout")
    launch_mode: str = "emulated"
    world_size: int = schema_default("train.world_size")
    device: str = schema_default("calibration.device")
    precision: str = schema_default("train.precision")
    steps: int | str = schema_default("train.steps")  # or WHOLE_EPOCH: one whole epoch timed
    warmup_steps: int = schema_default("train.warmup_steps")
    epochs: int = schema_default("train.epochs")  # whole epochs of `steps: epoch`
    # the closed loop: "off", "epoch" or K (every K timed steps): training.refine.refine_mode
    refine: str | int = schema_default("train.refine")
    val_every: int = schema_default("train.val_every")  # 0: no validation
    val_per_class: int = schema_default("train.val_per_class")
    checkpoint_every: int = schema_default("train.checkpoint_every")
    # how micro-batches are fetched (training.reader): not the math, so not in the fingerprint
    reader_workers: int = schema_default("train.reader_workers")
    prefetch_depth: int = schema_default("train.prefetch_depth")
    fsdp: bool = schema_default("train.fsdp")
    activation_checkpointing: bool = schema_default("train.activation_checkpointing")
    init_from: str = schema_default("model.init_from")  # scratch, or a checkpoint's path
    lora: LoraSpec | None = None  # train.lora; None: every weight trains
    # init_from's content digest (finetune.checkpoint_digest), read once here; None: scratch
    init_digest: str | None = field(default=None, init=False)
    optim: OptimConfig = field(default_factory=OptimConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    def __post_init__(self) -> None:
        if self.batch_layout == AUTO_LAYOUT:  # the run records the layout it runs
            layout = "packed" if get_policy(self.policy).packed else "dense"
            object.__setattr__(self, "batch_layout", layout)
        for name, allowed in (
            ("launch_mode", LAUNCH_MODES),
            ("kernel", KERNELS),
            ("batch_layout", LAYOUTS),
            ("device", DEVICES),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(f"{name} '{getattr(self, name)}': expected one of {allowed}")
        self._resolve_precision()
        if self.init_from != SCRATCH:  # the checkpoint's content, read once: the identity
            object.__setattr__(self, "init_digest", checkpoint_digest(self.init_from))
        if self.lora is not None and self.fsdp:
            raise UserError("train.lora with train.fsdp: not supported (LoRA checkpoints are "
                            "written unsharded); set train.fsdp: false, the adapters are small")
        check_world_size(self.world_size)
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed {self.seed}: must be between 0 and {2**32 - 1}")
        if self.fsdp and self.launch_mode != "distributed":
            raise UserError("train.fsdp: FSDP2 shards over real processes; launch with torchrun")
        if self.steps != WHOLE_EPOCH and (
            isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1
        ):
            raise UserError(f"--steps {self.steps!r}: expected a positive count or '{WHOLE_EPOCH}'")
        refine_mode(self.refine)  # refused here unless one of its forms
        if self.epochs != 1 and self.steps != WHOLE_EPOCH:
            raise UserError(
                f"train.epochs={self.epochs}: whole epochs need train.steps: {WHOLE_EPOCH} "
                f"(got steps={self.steps!r}); set steps: {WHOLE_EPOCH} or drop epochs"
            )
        if self.steps != WHOLE_EPOCH and self.warmup_steps >= self.steps:
            raise UserError(
                f"train.warmup_steps={self.warmup_steps} must be below steps={self.steps}: "
                "metrics are computed over the steps after warm-up"
            )

    def _resolve_precision(self) -> None:
        if self.precision == AUTO_PRECISION:  # the run records the precision it runs
            auto = "bf16" if self.device == "cuda" else "fp32"
            object.__setattr__(self, "precision", auto)
        if self.precision not in PRECISIONS:
            allowed = [AUTO_PRECISION, *PRECISIONS]
            raise UserError(f"train.precision '{self.precision}': expected one of {allowed}")
        if self.precision == "fp16" and self.device != "cuda":
            raise UserError(
                "train.precision fp16: CUDA only (loss-scaled fp16 autocast); "
                "use bf16 or fp32 on cpu"
            )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward and backward run in under autocast; None: fp32, no autocast."""
        return None if self.precision == "fp32" else PRECISIONS[self.precision]

    @cached_property
    def execution(self) -> Execution:
        """The layout and attention backend of this run, chosen here once from the config and
        the device: the model runs them, the loop feeds them, the run's tags record them (not
        a field: the choice follows from `batch_layout` and `device`, already in the
        fingerprint)."""
        return Execution.on(self.batch_layout, torch.device(self.device))

    @property
    def timed_window(self) -> str:
        """"epoch": the timed steps are one whole epoch (every policy then processes the same
        samples); "steps": a fixed number of steps, whatever samples they hold."""
        return window_kind(self.steps)

    @property
    def run_name(self) -> str:
        """One MLflow run per (experiment, policy, seed, kernel, launch mode)."""
        return f"{self.policy}-s{self.seed}-{self.kernel}-{self.launch_mode}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that determines the batches and the math: not the step count (a
        longer run continues a shorter one), but whether the warm-up is replayed (`epoch`)."""
        data = self.to_dict()
        # the checkpoint by its content, wherever it lies; a run from scratch without LoRA
        # or a closed loop keeps the fingerprint it had before these fields existed
        del data["init_from"]
        for key in ("init_digest", "lora"):
            if data[key] is None:
                del data[key]
        if data["refine"] == "off":
            del data["refine"]
        data["whole_epoch"] = data.pop("steps") == WHOLE_EPOCH
        del data["reader_workers"], data["prefetch_depth"]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def from_experiment(
    experiment: dict[str, Any],
    policy: str,
    seed: int,
    *,
    launch_mode: str,
    world_size: int,
    steps: int | str | None = None,
    kernel: str | None = None,
    device: str | None = None,
) -> TrainConfig:
    """TrainConfig from `adaptiveload.experiment.load(...)` output plus command-line overrides."""
    # (a stage view holds neither list: the pipeline names the policy and kernel of the run)
    if "policies" in experiment and policy not in experiment["policies"]:
        raise UserError(
            f"--policy {policy}: not among this experiment's policies {experiment['policies']}"
        )
    train = experiment["train"]
    return TrainConfig(
        experiment=experiment["name"],
        policy=policy,
        seed=seed,
        model=experiment["model"]["config"],
        kernel=kernel or experiment["model"]["kernels"][0],
        batch_layout=experiment["model"]["batch_layout"],
        launch_mode=launch_mode,
        world_size=world_size,
        device=device or train["device"] or experiment["calibration"]["device"],
        precision=train["precision"],
        steps=steps if steps is not None else train["steps"],
        warmup_steps=train["warmup_steps"],
        epochs=train["epochs"],
        refine=refine_mode(train["refine"]),
        val_every=train["val_every"],
        val_per_class=train["val_per_class"],
        checkpoint_every=train["checkpoint_every"],
        reader_workers=train["reader_workers"],
        prefetch_depth=train["prefetch_depth"],
        fsdp=train["fsdp"],
        activation_checkpointing=train["activation_checkpointing"],
        init_from=experiment["model"]["init_from"],
        lora=lora_spec(train["lora"]),
        optim=OptimConfig(
            lr=train["lr"], weight_decay=train["weight_decay"], grad_clip=train["grad_clip"],
            lr_warmup_steps=train["lr_warmup_steps"],
            lr_decay_fraction=train["lr_decay_fraction"],
        ),
        objective=ObjectiveConfig(
            timestep_shift=train["timestep_shift"],
            timestep_sampling=train["timestep_sampling"],
            logit_mean=train["logit_mean"],
            logit_std=train["logit_std"],
        ),
    )
