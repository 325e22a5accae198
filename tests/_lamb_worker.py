"""One rank of the 2-process LAMB and StableAdamW layout tests (launched by tests/test_lamb.py).

Usage: RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
       python tests/_lamb_worker.py OUT_DIR

Runs every scenario in one process pair (DeepSpeed start-up is the slow part) and writes
OUT_DIR/rank{r}.pt: {scenario: {name: full tensor}}.  The test process trains the plain
reference LAMB on the same data (the deterministic generators below) and compares.

Scenarios:
  flat_dp     a flat fp32 buffer holding several params (one straddling the rank boundary,
              one entirely on rank 0, padding between params and at the end) split between
              2 "DP" ranks; each rank steps only its half with a NormLayout.
  tp          a weight and a bias split along dim 0 over 2 "TP" ranks
              (tensor_model_parallel=True) plus a replicated param.
  zero{1,2,3} a small model under deepspeed.initialize with ZeRO-S, DP=2, Lamb as client
              optimizer with layout_for_deepspeed (fp32: DeepSpeedZeroOptimizer, Stage3).
  bf16_zero{0,1}  the same in bf16 (FP16_UnfusedOptimizer, BF16_Optimizer wrappers).
  bf16_zero0_multi_tensor  bf16_zero0 with the trainer's multi-tensor step of FP16_UnfusedOptimizer.
Each LAMB scenario also runs with optimizer.fused ("fused_" + name, its Adam direction compiled).
Each has a "<name>_naive" twin that skips the layout/groups: it must NOT match the reference.
The same scenarios with StableAdamW ("saw_" + name; bf16 at ZeRO-1 only), their gradients scaled
up step by step (SAW_SCALES) so that its update clipping engages, run in the same process pair.
"""

from __future__ import annotations

import os
import sys

import torch

STEPS = 3
LR = 0.05
SAW_LR = 0.05
# StableAdamW's RMS term is 1 at step 1 (v = g^2) and exceeds 1 where a gradient grows against its
# history: the growing scales make the update clipping engage, where the layout matters.
SAW_SCALES = (1.0, 4.0, 16.0)

# --- deterministic data shared with the test process -------------------------------------

# flat_dp: (name, shape) in buffer order, with the number of padding elements after each.
FLAT_PARAMS = [("a0", (3,), 0), ("A", (4, 5), 0), ("b", (3,), 1), ("C", (6,), 0), ("d", (2, 2), 0)]
FLAT_TOTAL = 40  # 37 used elements, 3 of alignment padding at the end; 20 per rank


def flat_offsets():
    offsets, pos = {}, 0
    for name, shape, pad in FLAT_PARAMS:
        offsets[name] = pos
        pos += torch.Size(shape).numel() + pad
    assert pos <= FLAT_TOTAL
    return offsets


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def flat_init_full() -> dict[str, torch.Tensor]:
    g = _gen(1)
    return {name: torch.randn(shape, generator=g) for name, shape, _ in FLAT_PARAMS}


def flat_grads_full(step, scales=None) -> dict[str, torch.Tensor]:
    g, scale = _gen(100 + step), 1.0 if scales is None else scales[step]
    return {name: scale * torch.randn(shape, generator=g) for name, shape, _ in FLAT_PARAMS}


TP_SHAPES = {"P": (6, 4), "S": (6,), "R": (5,)}  # P, S sharded along dim 0; R replicated


def tp_init_full():
    g = _gen(2)
    return {name: torch.randn(shape, generator=g) for name, shape in TP_SHAPES.items()}


def tp_grads_full(step, scales=None):
    g, scale = _gen(200 + step), 1.0 if scales is None else scales[step]
    return {name: scale * torch.randn(shape, generator=g) for name, shape in TP_SHAPES.items()}


TP_GROUPS = [dict(names=["P", "S"], weight_decay=0.01), dict(names=["R"], weight_decay=0.0)]
FLAT_GROUP = dict(weight_decay=0.01)


class SmallNet(torch.nn.Module):
    """Sizes chosen so ZeRO partitions cut through parameters (see test_lamb.py)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.fc2 = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_net() -> SmallNet:
    torch.manual_seed(3)
    net = SmallNet()
    with torch.no_grad():  # LayerNorm starts at 1/0; perturb so its norms are not trivial
        net.norm.weight.add_(0.1 * torch.randn(7))
        net.norm.bias.add_(0.1 * torch.randn(7))
    return net


def net_param_groups(net):
    """weights: decay + adaptation; biases: adaptation without decay; LayerNorm: neither."""
    return [
        dict(params=[net.fc1.weight, net.fc2.weight], weight_decay=0.01, layer_adaptation=True),
        dict(params=[net.fc1.bias, net.fc2.bias], weight_decay=0.0, layer_adaptation=True),
        dict(params=[net.norm.weight, net.norm.bias], weight_decay=0.0, layer_adaptation=False),
    ]


def net_batch(step):
    g = _gen(300 + step)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


# --- the whole-tensor references the tests compare the ranks with (one process, no layout) -----
# `update(name, w, g, group)` is one step of the reference optimizer on one whole tensor (the
# tests' closures keep its state per name); `scales` multiply the loss (the gradients) per step.

def reference_flat(update, scales=None) -> dict[str, torch.Tensor]:
    weights = flat_init_full()
    for step in range(STEPS):
        for n, g in flat_grads_full(step, scales).items():
            weights[n] = update(n, weights[n], g, FLAT_GROUP)
    return weights


def reference_tp(update, scales=None) -> dict[str, torch.Tensor]:
    weights = tp_init_full()
    group_of = {n: group for group in TP_GROUPS for n in group["names"]}
    for step in range(STEPS):
        for n, g in tp_grads_full(step, scales).items():
            weights[n] = update(n, weights[n], g, group_of[n])
    return weights


def reference_net(update, scales=None) -> tuple[dict[str, torch.Tensor], SmallNet]:
    net = make_net()
    names = {id(p): n for n, p in net.named_parameters()}
    group_of = {names[id(p)]: group for group in net_param_groups(net) for p in group["params"]}
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    for step in range(STEPS):
        x, y = net_batch(step)
        params = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
        loss = torch.nn.functional.mse_loss(torch.func.functional_call(net, params, (x,)), y)
        grads = torch.autograd.grad(loss * (scales[step] if scales else 1.0), list(params.values()))
        for (n, w), g in zip(list(weights.items()), grads):
            weights[n] = update(n, w, g, group_of[n])
    return weights, net


def new_state(w):
    return {"t": 0, "m": torch.zeros_like(w), "v": torch.zeros_like(w)}


def assert_rel(actual, expected, tol, what=""):
    """max |a - e| <= tol * max |e|."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol} * {scale:.3e}"


# --- scenarios --------------------------------------------------------------------------

def _optimizer(stable, fused=False):
    """(class, lr, gradient scales per step) of the scenario's optimizer (fused: LAMB with
    optimizer.fused's compiled direction)."""
    import functools

    from pretrain.optim import Lamb, StableAdamW
    if fused:
        return functools.partial(Lamb, fused=True), LR, None
    return (StableAdamW, SAW_LR, SAW_SCALES) if stable else (Lamb, LR, None)


def run_flat_dp(rank, world, use_layout, stable=False, fused=False):
    import torch.distributed as dist
    from pretrain.optim import NormLayout, Segment

    Opt, lr, scales = _optimizer(stable, fused)

    offsets, part = flat_offsets(), FLAT_TOTAL // world
    lo, hi = rank * part, (rank + 1) * part
    # Padding holds garbage weights and gradients: it must neither enter the norms nor move.
    full = torch.full((FLAT_TOTAL,), 7.0)
    for name, w in flat_init_full().items():
        full[offsets[name]:offsets[name] + w.numel()] = w.reshape(-1)
    local = full[lo:hi].clone()

    segments = []
    for index, (name, shape, _) in enumerate(FLAT_PARAMS):
        start, end = offsets[name], offsets[name] + torch.Size(shape).numel()
        if max(start, lo) < min(end, hi):
            segments.append(Segment(index, max(start, lo) - lo, min(end, hi) - max(start, lo)))
    opt = Opt([local], lr=lr, **FLAT_GROUP)
    if use_layout:
        opt.set_layout(NormLayout([(local, segments)], [False] * len(FLAT_PARAMS), dp_group=dist.group.WORLD))
    for step in range(STEPS):
        grad = torch.full((FLAT_TOTAL,), -3.0)
        for name, gr in flat_grads_full(step, scales).items():
            grad[offsets[name]:offsets[name] + gr.numel()] = gr.reshape(-1)
        local.grad = grad[lo:hi].clone()
        opt.step()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return {"flat": torch.cat(gathered)}


def run_tp(rank, world, use_layout, stable=False, fused=False):
    import torch.distributed as dist
    from pretrain.optim import layout_for_params

    Opt, lr, scales = _optimizer(stable, fused)

    def shard(name, t):
        return t.chunk(world, dim=0)[rank].clone() if name != "R" else t.clone()

    params = {}
    for name, t in tp_init_full().items():
        params[name] = shard(name, t)
        params[name].tensor_model_parallel = name != "R"
    groups = [dict(params=[params[n] for n in g["names"]], weight_decay=g["weight_decay"])
              for g in TP_GROUPS]
    opt = Opt(groups, lr=lr)
    if use_layout:
        opt.set_layout(layout_for_params([g["params"] for g in groups], tp_group=dist.group.WORLD))
    for step in range(STEPS):
        for name, gr in tp_grads_full(step, scales).items():
            params[name].grad = shard(name, gr)
        opt.step()
    out = {}
    for name, p in params.items():
        if name == "R":
            out[name] = p.clone()  # each rank reports its copy; the test checks both
        else:
            gathered = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(gathered, p)
            out[name] = torch.cat(gathered)
    return out


def run_deepspeed(rank, world, stage, use_layout, bf16=False, stable=False, fused=False, multi_tensor=False):
    import deepspeed
    import torch.distributed as dist
    from pretrain.optim import layout_for_deepspeed

    Opt, lr, scales = _optimizer(stable, fused)
    net = make_net()
    opt = Opt(net_param_groups(net), lr=lr)
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }
    if stage == 2:
        # Exercise DeepSpeed's per-parameter alignment padding and reordered flat buffers.
        config["zero_optimization"].update(round_robin_gradients=True, parameter_alignment=True)
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if bf16:
        # ZeRO-1 + fp32 gradient accumulation -> BF16_Optimizer; ZeRO-0 -> FP16_UnfusedOptimizer.
        config["bf16"] = {"enabled": True}
        if stage == 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    from pretrain.distributed.internals import no_optimizer_steps

    with no_optimizer_steps(opt):  # FP16_UnfusedOptimizer (bf16 ZeRO-0) would step once, as the trainer guards
        engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    if multi_tensor:  # bf16 ZeRO-0: the trainer's multi-tensor replacement of the wrapper's step
        from pretrain.distributed import internals
        internals.disable_wrapper_clipping(engine)
        assert internals.multi_tensor_bf16_step(engine)
    if use_layout:
        layout = layout_for_deepspeed(engine, tp_group=None, dp_group=dist.group.WORLD)
        assert (layout.dp_group is not None) == (stage > 0), \
            "ZeRO layouts must reduce over DP, ZeRO-0 ones must not"
        opt.set_layout(layout)
        # Elements of each logical parameter this rank holds: lets the test check that the
        # partitioning really cut parameters (otherwise it would prove nothing).
        held = torch.zeros(layout.num_logical, dtype=torch.long)
        for _, segments in layout.entries():
            for seg in segments:
                held[seg.logical_index] += seg.numel
    for step in range(STEPS):
        x, y = net_batch(step)
        rows = slice(2 * rank, 2 * rank + 2)
        dtype = torch.bfloat16 if bf16 else torch.float32
        loss = torch.nn.functional.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])
        if scales is not None:
            loss = scales[step] * loss
        engine.backward(loss)
        if step == STEPS - 1:  # the last step's host syncs (.item()) and dispatched operations
            from torch.profiler import profile
            with profile() as prof:
                engine.step()
            names = [event.name for event in prof.events()]
            ops = {"syncs": names.count("aten::_local_scalar_dense"),
                   "operations": sum(name.startswith("aten::") for name in names)}
        else:
            engine.step()
    params = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            out = {name: p.detach().clone() for name, p in params}
    else:
        out = {name: p.detach().clone() for name, p in params}
    if use_layout:
        out["__held__"] = held
        out["__optimizer__"] = type(engine.optimizer).__name__
    out["__step_ops__"] = ops
    engine.destroy()
    return out


def main(out_dir):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    import deepspeed
    from pretrain.distributed.internals import without_shared_memory_comm

    with without_shared_memory_comm():  # as init_parallel starts it: no inference op compiled
        deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for use_layout in (True, False):
        suffix = "" if use_layout else "_naive"
        results["flat_dp" + suffix] = run_flat_dp(rank, world, use_layout)
        results["tp" + suffix] = run_tp(rank, world, use_layout)
        for stage in (1, 2, 3):
            results[f"zero{stage}{suffix}"] = run_deepspeed(rank, world, stage, use_layout)
        for stage in (0, 1):
            results[f"bf16_zero{stage}{suffix}"] = run_deepspeed(rank, world, stage, use_layout, bf16=True)
        results["saw_flat_dp" + suffix] = run_flat_dp(rank, world, use_layout, stable=True)
        results["saw_tp" + suffix] = run_tp(rank, world, use_layout, stable=True)
        for stage in (1, 2, 3):
            results[f"saw_zero{stage}{suffix}"] = run_deepspeed(rank, world, stage, use_layout, stable=True)
        results["saw_bf16_zero1" + suffix] = run_deepspeed(rank, world, 1, use_layout, bf16=True, stable=True)
    results["bf16_zero0_multi_tensor"] = run_deepspeed(rank, world, 0, True, bf16=True, multi_tensor=True)
    # LAMB with optimizer.fused (its Adam direction compiled): the same scenarios, layouts on
    results["fused_flat_dp"] = run_flat_dp(rank, world, True, fused=True)
    results["fused_tp"] = run_tp(rank, world, True, fused=True)
    for stage in (1, 2, 3):
        results[f"fused_zero{stage}"] = run_deepspeed(rank, world, stage, True, fused=True)
    for stage in (0, 1):
        results[f"fused_bf16_zero{stage}"] = run_deepspeed(rank, world, stage, True, bf16=True, fused=True)
    from pretrain.model.fused import compile_counters
    results["fused_compiles"] = compile_counters()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1])
