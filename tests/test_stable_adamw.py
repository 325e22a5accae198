"""StableAdamW: equal to torch-optimi's StableAdamW on one process, and layout-exact (the update
clipping's RMS over whole logical parameters) under DP partitioning, TP sharding and DeepSpeed
ZeRO-1/2/3 and bf16 (2 gloo processes: the StableAdamW scenarios of _lamb_worker.py, run in the
LAMB tests' process pair).

The layout comparisons are against `ref_stable_adamw_step` below: a plain whole-tensor
StableAdamW written from the formulas, independent of both our class and torch-optimi."""

from __future__ import annotations

import math

import pytest
import torch

import _lamb_worker as W
from _lamb_worker import assert_rel, new_state
from pretrain.optim import StableAdamW, build_optimizer


# --- independent reference ----------------------------------------------------------------------

def ref_stable_adamw_step(w, g, st, lr, wd=0.0, betas=(0.9, 0.99), eps=1e-6, decouple_lr=False, max_lr=None,
                          halves=False):
    """One StableAdamW step on a whole tensor; returns the new weight and the RMS.  st: {'t', 'm', 'v'}.
    halves=True: the RMS of each half of the flattened tensor separately, as an implementation
    that sees only shards would compute it (the negative control)."""
    b1, b2 = betas
    st["t"] += 1
    t = st["t"]
    b1_hat, b2_hat = (b1 ** t - b1) / (b1 ** t - 1), (b2 ** t - b2) / (b2 ** t - 1)
    st["m"] = b1_hat * st["m"] + (1 - b1_hat) * g
    st["v"] = b2_hat * st["v"] + (1 - b2_hat) * g * g
    terms = (g * g / st["v"].clamp(min=eps ** 2)).reshape(-1)
    if halves:
        parts = terms.tensor_split(2)
        rms = torch.cat([torch.full((len(p),), p.double().mean().sqrt().item()) for p in parts]).view_as(w)
    else:
        rms = torch.full_like(w, terms.double().mean().sqrt().item())
    lr_t = lr / rms.clamp(min=1.0)
    if wd:
        w = w * (1 - (lr_t / (max_lr or lr) if decouple_lr else lr_t) * wd)
    w = w - lr_t * st["m"] / (st["v"].sqrt() + eps)
    return w, rms.max().item()


def differs(actual, expected) -> bool:
    err = (actual - expected).abs().max().item()
    return math.isnan(err) or err > 1e-4 * expected.abs().max().item()


# --- single process -------------------------------------------------------------------------------

SPECS = {  # name: (shape, group settings, gradient scale per step: growing scales make rms > 1)
    "W": ((8, 6), dict(weight_decay=0.1)),
    "V": ((17,), dict(weight_decay=0.0)),
    "T": ((3, 4, 5), dict(weight_decay=0.05, betas=(0.8, 0.95))),
    "b": ((5,), dict(weight_decay=0.0, eps=1e-3)),
}
STEPS = 20


def _gradients(seed=0):
    g = torch.Generator().manual_seed(seed)
    # per-step scales that jump up now and then: the current gradient large against its history
    scales = [1.0, 3.0, 0.5, 1.0, 6.0, 1.0, 1.0, 0.2, 4.0, 1.0] * 2
    return [{n: scales[s] * torch.randn(shape, generator=g) for n, (shape, _) in SPECS.items()} for s in range(STEPS)]


@pytest.mark.parametrize("decouple_lr", [False, True], ids=["decoupled-wd", "decouple_lr"])
def test_matches_torch_optimi(decouple_lr):
    optimi = pytest.importorskip("optimi")
    lr = 0.02
    init = {n: torch.randn(shape, generator=torch.Generator().manual_seed(1)) for n, (shape, _) in SPECS.items()}
    ours = {n: torch.nn.Parameter(w.clone()) for n, w in init.items()}
    theirs = {n: torch.nn.Parameter(w.clone()) for n, w in init.items()}
    max_lr = 0.04 if decouple_lr else None  # lr below the peak, as mid-schedule
    opt = StableAdamW([dict(params=[ours[n]], layer_adaptation=True, **cfg) for n, (_, cfg) in SPECS.items()],
                      lr=lr, decouple_lr=decouple_lr, max_lr=max_lr)
    with pytest.warns(UserWarning) if decouple_lr else _nothing():  # optimi warns about weight_decay >= 1e-3
        ref = optimi.StableAdamW([dict(params=[theirs[n]], **_optimi_keys(cfg)) for n, (_, cfg) in SPECS.items()], lr=lr,
                                 decouple_lr=decouple_lr, max_lr=max_lr, kahan_sum=False, foreach=False, triton=False)
    mine = {n: w.clone() for n, w in init.items()}
    states = {n: new_state(w) for n, w in init.items()}
    clipped = 0
    for grads in _gradients():
        for n, grad in grads.items():
            ours[n].grad, theirs[n].grad = grad.clone(), grad.clone()
            cfg = SPECS[n][1]
            mine[n], rms = ref_stable_adamw_step(mine[n], grad, states[n], lr, wd=cfg["weight_decay"],
                                                 betas=cfg.get("betas", (0.9, 0.99)), eps=cfg.get("eps", 1e-6),
                                                 decouple_lr=decouple_lr, max_lr=max_lr)
            clipped += rms > 1
        opt.step()
        ref.step()
        for n in SPECS:
            assert_rel(ours[n].detach(), theirs[n].detach(), 1e-6, f"{n} vs optimi")
            assert_rel(mine[n], theirs[n].detach(), 1e-6, f"{n}: the test's reference vs optimi")
    assert clipped >= 10, f"the update clipping engaged on only {clipped} tensor-steps"
    assert set(opt.state[ours["W"]]) == {"step", "exp_avg", "exp_avg_sq"} and opt.state[ours["W"]]["step"] == STEPS


def _optimi_keys(cfg: dict) -> dict:
    """optimi's groups spell the betas beta1, beta2 (a `betas` key would be silently ignored)."""
    cfg = dict(cfg)
    if "betas" in cfg:
        cfg["beta1"], cfg["beta2"] = cfg.pop("betas")
    return cfg


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_per_shard_rms_differs():
    """The negative control: the RMS taken per half-tensor (what an optimizer that sees only
    shards computes) gives other weights once the clipping engages."""
    w0 = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    whole, halves = w0.clone(), w0.clone()
    sw, sh = new_state(w0), new_state(w0)
    for grads in _gradients(3)[:6]:
        g = grads["W"]
        g[:4] *= 5 * sw["t"]  # one half's gradients grow: its RMS leaves the other's
        whole, _ = ref_stable_adamw_step(whole, g, sw, 0.02, wd=0.1)
        halves, _ = ref_stable_adamw_step(halves, g, sh, 0.02, wd=0.1, halves=True)
    assert differs(halves, whole), "per-half RMS gives the whole-tensor result"


def test_zero_gradient_and_no_host_sync_state():
    """A zero gradient: rms 0 (no clipping), m and v stay 0, only weight decay moves the weights."""
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.zeros(4)
    opt = StableAdamW([p], lr=0.1, weight_decay=0.5)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((4,), 1 - 0.1 * 0.5))
    assert isinstance(opt.state[p]["step"], int)


def test_kahan_sum_bf16_tracks_torch_optimi():
    """bf16 weights, updates (lr 1e-3) mostly below bf16's resolution: with kahan_sum they are
    not lost, as in optimi's Kahan-summed StableAdamW (equal up to bf16 rounding of the
    intermediate terms, computed in another order), while plain bf16 updates drift off."""
    optimi = pytest.importorskip("optimi")
    g = torch.Generator().manual_seed(4)
    init = torch.randn(64, generator=g)
    ps = {k: torch.nn.Parameter(init.clone() if k == "fp32" else init.bfloat16()) for k in ("fp32", "kahan", "plain", "optimi")}
    opts = {"fp32": StableAdamW([ps["fp32"]], lr=1e-3, weight_decay=0.01),
            "kahan": StableAdamW([ps["kahan"]], lr=1e-3, weight_decay=0.01, kahan_sum=True),
            "plain": StableAdamW([ps["plain"]], lr=1e-3, weight_decay=0.01),
            "optimi": optimi.StableAdamW([ps["optimi"]], lr=1e-3, weight_decay=0.01, kahan_sum=True, foreach=False,
                                         triton=False)}
    for _ in range(30):
        grad = torch.randn(64, generator=g)
        for p in ps.values():
            p.grad = grad.to(p.dtype)
        for opt in opts.values():
            opt.step()
    assert "kahan_comp" in opts["kahan"].state[ps["kahan"]] and "kahan_comp" not in opts["plain"].state[ps["plain"]]

    def err(a, b):
        return (ps[a].detach().float() - ps[b].detach().float()).abs().max().item()
    assert err("kahan", "optimi") < err("plain", "optimi") / 3
    assert err("kahan", "fp32") <= 1.1 * err("optimi", "fp32")


def test_build_optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer("stable_adamw", [dict(params=[p], weight_decay=0.0, layer_adaptation=False)], lr=1e-3,
                          betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, decouple_lr=True, max_lr=None, kahan_sum=False)
    assert isinstance(opt, StableAdamW) and opt.param_groups[0]["max_lr"] == 1e-3


# --- references of the 2-process tests (test_lamb.py: they share its process pair) -------------


def saw_update(clipped: list):
    """The reference StableAdamW's step on whole tensors (_lamb_worker.reference_*), its state kept
    per name; the name of every step whose update clipping engaged (rms > 1) goes into `clipped`."""
    states = {}

    def update(name, w, g, group):
        w, rms = ref_stable_adamw_step(w, g, states.setdefault(name, new_state(w)), W.SAW_LR, wd=group["weight_decay"])
        if rms > 1:
            clipped.append(name)
        return w
    return update


def saw_flat_reference():
    clipped = []
    return W.reference_flat(saw_update(clipped), W.SAW_SCALES), len(clipped)


def saw_tp_reference():
    clipped = []
    return W.reference_tp(saw_update(clipped), W.SAW_SCALES), set(clipped)


def saw_net_reference():
    clipped = []
    weights, net = W.reference_net(saw_update(clipped), W.SAW_SCALES)
    return weights, net, set(clipped)
