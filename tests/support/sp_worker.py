"""One torchrun process of the sequence-parallel exactness tests
(tests/slow/model/test_sp_model_slow.py), for WanModel and for diffusers' model through
`PackedWan` (the "diffusers" cases, when diffusers is installed):
`torchrun --nproc-per-node N tests/support/sp_worker.py OUT` (N = 2 or 4, gloo on CPU).

Each case splits the world into SP groups (a partition such as {1, 1, 2}: ranks 0 and 1
alone, ranks 2-3 a group of two); group g runs micro-batch g, a packed mix of shapes. Every
process also runs every micro-batch unsharded, the reference. Per case and rank it writes
the worst relative errors of: the gathered outputs; the parameter gradients summed over the
SP group against its micro-batch's; the gradients summed over the world against the sum of
every micro-batch's once (what a data-parallel all-reduce over the whole world sees); and
whether perturbing one sample's latent leaves another's outputs and gradients bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from adaptiveload.data.packed import collate
from adaptiveload.model.architectures import WanConfig, get_config
from adaptiveload.model.wan import WanModel
from adaptiveload.model.weights import layout_config

# 4 heads of 8 (RoPE 4/2/2), so degrees 1, 2 and 4 all divide them; two blocks
CFG = WanConfig("sp-test", dim=32, ffn_dim=64, num_heads=4, num_layers=2, freq_dim=32,
                text_len=8, text_dim=32)
# latent [T', H', W'] shapes: 48, 24 (two grids), 30, 9, 5 and 4 tokens (remainders mod 2
# and 4); two 48-token samples share a run, the pair the isolation check perturbs
MIX = [(3, 8, 8), (1, 8, 12), (1, 12, 8), (2, 6, 10), (1, 6, 6), (1, 2, 10), (3, 8, 8),
       (1, 4, 4)]
PARTITIONS = {2: ["{2}"], 4: ["{1,1,2}", "{2,2}", "{4}"]}
GROUPS = {"{2}": [[0, 1]], "{1,1,2}": [[0], [1], [2, 3]], "{2,2}": [[0, 1], [2, 3]],
          "{4}": [[0, 1, 2, 3]]}


def model(impl: str, checkpointing: bool = False) -> WanModel:
    torch.manual_seed(0)
    m = WanModel(CFG, ln_modulate_impl=impl, activation_checkpointing=checkpointing)
    with torch.no_grad():  # Wan zero-inits the head, which would hide every upstream gradient
        m.head.head.weight.normal_(std=0.02)
    return m


def diffusers_model(impl: str, checkpointing: bool = False) -> torch.nn.Module:
    """diffusers' WanTransformer3DModel of CFG, every weight perturbed, in PackedWan (`impl`
    is WanModel's; diffusers' norms have one implementation)."""
    import diffusers

    from adaptiveload.model.diffusers_wan import PackedWan

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(**layout_config(CFG, "diffusers"))
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    return PackedWan(transformer)


def micro_batch(index: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list]:
    """Micro-batch `index`: latents (shape groups), timesteps, contexts, loss weights."""
    gen = torch.Generator().manual_seed(100 + index)
    items = [{"sample_id": f"s{i}", "latent": torch.randn(CFG.in_dim, *shape, generator=gen),
              "context": torch.randn(CFG.text_len, CFG.text_dim, generator=gen)}
             for i, shape in enumerate(MIX)]
    batch = collate(items)
    t = torch.rand(batch.num_samples, generator=gen) * 1000
    weights = [torch.randn(g.shape, generator=gen) for g in batch.latents]
    return list(batch.latents), t, batch.context, weights


def run(m: WanModel, batch: tuple, group=None, only_first: bool = False) -> tuple:
    """Outputs and parameter gradients of sum_i <out_i, w_i> (of the first sample only with
    `only_first`)."""
    latents, t, context, weights = batch
    m.zero_grad(set_to_none=True)
    outs = m(latents, t, context, sp_group=group)
    if only_first:
        loss = (outs[0][0] * weights[0][0]).sum()
    else:
        loss = sum((o * w).sum() for o, w in zip(outs, weights, strict=True))
    loss.backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in m.named_parameters()}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def worst(got: dict | list, want: dict | list) -> float:
    if isinstance(got, dict):
        got, want = [got[n] for n in want], list(want.values())
    return max(rel(a, b) for a, b in zip(got, want, strict=True))


def isolated(m: WanModel, batch: tuple, group) -> bool:
    """Perturbing the second sample of the first shape group (same run as the first) leaves
    the first sample's output and its loss's gradients on this rank bit for bit, and moves
    the second's output."""
    latents, t, context, weights = batch
    assert latents[0].shape[0] >= 2
    bumped = latents[0].clone()
    bumped[1] += 1.0
    outs, grads = run(m, batch, group, only_first=True)
    outs2, grads2 = run(m, ([bumped, *latents[1:]], t, context, weights), group, only_first=True)
    same = torch.equal(outs[0][0], outs2[0][0]) and all(
        torch.equal(grads[n], grads2[n]) for n in grads)
    return same and not torch.equal(outs[0][1], outs2[0][1])


def case(groups: list[list[int]], impl: str, checkpointing: bool, handles: dict,
         build=model) -> dict:
    rank = dist.get_rank()
    g = next(i for i, ranks in enumerate(groups) if rank in ranks)
    group = handles[tuple(groups[g])]
    m = build(impl, checkpointing)
    batches = [micro_batch(i) for i in range(len(groups))]
    refs = [run(m, b) for b in batches]
    outs, grads = run(m, batches[g], group)
    group_sum = {n: v.clone() for n, v in grads.items()}
    world_sum = {n: v.clone() for n, v in grads.items()}
    for n in grads:
        dist.all_reduce(group_sum[n], group=group)
        dist.all_reduce(world_sum[n])
    every_batch_once = {n: sum(r[1][n] for r in refs) for n in grads}
    result = {
        "outputs": worst(outs, refs[g][0]),
        "grads_group": worst(group_sum, refs[g][1]),
        "grads_world": worst(world_sum, every_batch_once),
        "isolated": isolated(m, batches[g], group),
    }
    if len(groups[g]) == 1:
        result["bitwise_unsharded"] = all(
            torch.equal(a, b) for a, b in zip(outs, refs[g][0], strict=True)
        ) and all(torch.equal(grads[n], refs[g][1][n]) for n in grads)
    return result


def refusals(world: int, handles: dict) -> list[str]:
    """What the model refuses, in one line each, on every rank before any collective."""
    whole = handles[tuple(range(world))]
    latents, t, context, _ = micro_batch(0)
    tries = [
        (WanModel(get_config("wan2.1-micro")), (latents, t, context), "does not divide"),
        (model("eager"), ([latents[0][:, :, :1, :2, :2]], t[:2], context[:2]), "empty chunks"),
        (model("eager"), (latents[0], t[:2], context[:2]), "packed micro-batches only"),
    ]
    if world != 4:  # 2 heads divide a group of two
        tries = tries[1:]
    if importlib.util.find_spec("diffusers") is not None:
        tries.append((diffusers_model("eager"), (latents[0], t[:2], context[:2]),
                      "packed micro-batches only"))
    messages = []
    for m, args, expect in tries:
        try:
            m(*args, sp_group=whole)
        except ValueError as err:
            assert expect in str(err), err
            messages.append(str(err))
        else:
            raise AssertionError(f"no refusal: {expect}")
    return messages


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    handles = {}
    for name in PARTITIONS[world]:  # every rank creates every group, in the same order
        for ranks in GROUPS[name]:
            handles[tuple(ranks)] = dist.new_group(ranks)
    handles.setdefault(tuple(range(world)), dist.new_group(list(range(world))))
    results = {}
    for name in PARTITIONS[world]:
        for impl in ("eager", "fused"):
            results[f"{name} {impl}"] = case(GROUPS[name], impl, False, handles)
    if world == 2:
        results["{2} eager checkpointed"] = case(GROUPS["{2}"], "eager", True, handles)
    if importlib.util.find_spec("diffusers") is not None:
        for name in PARTITIONS[world]:
            results[f"{name} diffusers"] = case(GROUPS[name], "eager", False, handles,
                                                diffusers_model)
        if world == 2:
            results["{2} diffusers checkpointed"] = case(GROUPS["{2}"], "eager", True, handles,
                                                         diffusers_model)
    report = {"cases": results, "refusals": refusals(world, handles)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
