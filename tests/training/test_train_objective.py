"""Rectified-flow objective and the loss weighting: emulated ranks give the mean gradient."""

from __future__ import annotations

import pytest
import torch
from training_setup import write_experiment

from adaptiveload import experiment
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import Trainer
from adaptiveload.training.objective import (
    per_sample_loss,
    sample_sigmas,
    shift_sigma,
    step_generator,
)
from adaptiveload.training.settings import ObjectiveConfig, from_experiment


def test_shift_matches_wan_formula():
    sigma = torch.tensor([0.0, 0.2, 0.5, 1.0], dtype=torch.float64)
    # shift 5: 5*0.2/(1+4*0.2) = 1/1.8; 5*0.5/3 = 5/6; endpoints fixed
    expected = torch.tensor([0.0, 1 / 1.8, 5 / 6, 1.0], dtype=torch.float64)
    torch.testing.assert_close(shift_sigma(sigma, 5.0), expected)
    torch.testing.assert_close(shift_sigma(sigma, 1.0), sigma)


@pytest.mark.parametrize("sampling", ["uniform", "logit-normal"])
def test_sigmas_in_range_and_shifted_up(sampling):
    cfg = ObjectiveConfig(timestep_shift=5.0, timestep_sampling=sampling)
    s = sample_sigmas(20000, cfg, step_generator(0, 0, 0))
    assert s.min() > 0 and s.max() < 1
    # shift 5 pushes the median of U(0,1) (or of the logit-normal, 0.5) to 5/6
    assert abs(float(s.median()) - 5 / 6) < 0.02


def test_step_generator_is_order_independent():
    a = torch.randn(4, generator=step_generator(3, 7, 1))
    torch.randn(100, generator=step_generator(3, 6, 1))  # other draws do not interfere
    assert torch.equal(a, torch.randn(4, generator=step_generator(3, 7, 1)))
    assert not torch.equal(a, torch.randn(4, generator=step_generator(3, 7, 2)))


def test_loss_targets_velocity():
    """A 'model' that outputs eps - x0 exactly (it sees x_t and sigma) gives zero loss."""

    class Oracle(torch.nn.Module):
        def __init__(self, x0):
            super().__init__()
            self.x0 = x0

        def forward(self, x_t, t, context):
            s = (t / 1000).view(-1, 1, 1, 1, 1).to(x_t.dtype)
            eps = (x_t - (1 - s) * self.x0) / s
            return eps - self.x0

    x0 = torch.randn(3, 16, 2, 4, 4, dtype=torch.float64)
    loss = per_sample_loss(Oracle(x0), x0, torch.zeros(3, 1, 1), ObjectiveConfig(),
                           step_generator(0, 0, 0))
    assert loss.shape == (3,)
    assert float(loss.abs().max()) < 1e-10  # t is fp32, as Wan feeds it


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_emulated_gradient_is_mean_over_all_samples(tmp_path):
    """The emulated N-rank accumulation equals the gradient of the mean per-sample loss over
    the whole step, and differs from the mean of per-rank means when batch sizes differ.
    fp32 with a tight tolerance: the model keeps Wan's fp32 time embedding, so no fp64."""
    torch.set_num_threads(1)
    exp = experiment.load(write_experiment(tmp_path))
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=3)
    data = prepare_data(exp, cfg)
    plan = data.builder(0).table
    sizes = plan.groupby(["step", "rank"]).size().unstack()
    step = int(sizes.index[sizes.nunique(axis=1) > 1][0])  # ranks hold different batch sizes
    position = {sid: i for i, sid in enumerate(data.builder.samples["sample_id"])}

    trainer = Trainer(cfg, data, tmp_path / "ckpt", Ranks.emulated(3), progress=False)
    for s in range(step + 1):  # earlier steps' gradients are zeroed by the next call
        rows = trainer.forward_backward(s)
    emulated = _flat_grad(trainer.model).clone()

    model = trainer.model
    losses = []
    for r in range(3):
        ids = plan[(plan["step"] == step) & (plan["rank"] == r)]["sample_id"]
        items = [data.dataset[position[sid]] for sid in ids]
        x0 = torch.stack([it["latent"] for it in items])
        ctx = torch.stack([it["context"] for it in items])
        gen = step_generator(cfg.seed, step, r)
        losses.append(per_sample_loss(model, x0, ctx, cfg.objective, gen))
    model.zero_grad(set_to_none=True)
    torch.cat(losses).mean().backward(retain_graph=True)
    reference = _flat_grad(model).clone()
    model.zero_grad(set_to_none=True)
    torch.stack([loss.mean() for loss in losses]).mean().backward()
    mean_of_means = _flat_grad(model)
    assert [m.row["samples"] for m in rows] == sizes.loc[step].tolist()
    torch.testing.assert_close(emulated, reference, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(emulated, mean_of_means, rtol=1e-2, atol=0)


def test_train_precision_sets_the_autocast_of_forward_and_backward(tmp_path):
    """train.precision reaches the step: bf16 on CPU runs forward and backward under bf16
    autocast (its gradients differ from fp32's, close to them; the zero-initialised head
    makes step 0's loss the same), fp32 (CPU's default) runs none; parameters stay fp32."""
    torch.set_num_threads(1)
    grads = {}
    for precision in ("fp32", "bf16"):
        exp = experiment.load(write_experiment(tmp_path, name=precision, precision=precision))
        cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=1)
        trainer = Trainer(cfg, prepare_data(exp, cfg), None, Ranks.emulated(1), progress=False)
        try:
            with trainer._autocast():
                assert torch.is_autocast_enabled("cpu") == (precision == "bf16")
            trainer.forward_backward(0)
            grads[precision] = _flat_grad(trainer.model)
            assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
        finally:
            trainer.close()
    assert not torch.equal(grads["bf16"], grads["fp32"])
    error = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert 0 < error < 0.1
