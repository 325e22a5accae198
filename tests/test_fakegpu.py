"""fakegpu (tests/bert-fakegpu/, installed by tools/install.sh): the CPU test mode that sees device defects.

Every check runs in child processes (enable() renames torch's PrivateUse1 device and installs a
DeepSpeed accelerator, which must not leak into the pytest process): one process runs the
single-process checks, two 2-rank jobs run the collectives and DeepSpeed ZeRO-1/ZeRO-3 on
fakegpu/fakeccl and, as the reference, on cpu/gloo. This file is also the worker script:
`python tests/test_fakegpu.py single` / `python tests/test_fakegpu.py dist fake|cpu`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
MARK = "FAKEGPU_RESULT "
NO_CPU_BACKEND = "No backend type associated with device type cpu"


def _result(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise AssertionError(f"worker printed no result:\n{text[-6000:]}")


# ============================================================================ single-process checks
def _single_checks():
    """name -> function; each raises on failure."""
    import torch
    import torch.nn.functional as F

    import fakegpu

    fakegpu.enable()
    dev = torch.device(fakegpu.DEVICE_TYPE, 0)
    checks = {}

    def check(fn):
        checks[fn.__name__] = fn
        return fn

    def same(a, b, exact=True):
        a = a.detach().cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if exact:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    @check
    def mlp_forward_backward_equals_cpu():
        torch.manual_seed(0)
        cpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                  torch.nn.Dropout(0.0), torch.nn.Linear(32, 4))
        fake = __import__("copy").deepcopy(cpu).to(dev)
        assert all(p.device == dev for p in fake.parameters())
        x = torch.randn(8, 16)
        out_c, out_f = cpu(x), fake(x.to(dev))
        assert out_f.device == dev
        same(out_f, out_c)
        out_c.square().mean().backward()
        out_f.square().mean().backward()
        for pc, pf in zip(cpu.parameters(), fake.parameters()):
            assert pf.grad.device == dev
            same(pf.grad, pc.grad)

    @check
    def dropout_and_rng_follow_cpu():
        torch.manual_seed(3)
        a = F.dropout(torch.ones(64, device=dev), 0.5, training=True)
        torch.manual_seed(3)
        b = F.dropout(torch.ones(64), 0.5, training=True)
        same(a, b)
        torch.manual_seed(5)
        g = torch.randn(10, device=dev)
        torch.manual_seed(5)
        same(g, torch.randn(10))

    @check
    def sdpa_forward_backward():
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
        qf, kf, vf = (t.detach().to(dev).requires_grad_() for t in (q, k, v))
        mask = torch.rand(5, 5) > 0.3
        mask.fill_diagonal_(True)
        out_c = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out_f = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask.to(dev))
        # fakegpu takes SDPA's math path, CPU its fused flash kernel: equal up to rounding
        same(out_f, out_c, exact=False)
        out_c.sum().backward()
        out_f.sum().backward()
        for a, b in ((qf, q), (kf, k), (vf, v)):
            same(a.grad, b.grad, exact=False)

    @check
    def lstm_forward_backward():
        """nn.LSTM takes the fused cell on any non-CPU device (fakegpu/_lstm.py there)."""
        import copy

        torch.manual_seed(0)
        lstm = torch.nn.LSTM(8, 6, num_layers=2, bidirectional=True, batch_first=True)
        lstm_f = copy.deepcopy(lstm).to(dev)
        x = torch.randn(3, 5, 8, requires_grad=True)
        x_f = x.detach().to(dev).requires_grad_()
        lengths = torch.tensor([5, 3, 2])
        outputs = []
        for module, inputs in ((lstm, x), (lstm_f, x_f)):
            packed = torch.nn.utils.rnn.pack_padded_sequence(inputs, lengths, batch_first=True, enforce_sorted=False)
            out, _ = torch.nn.utils.rnn.pad_packed_sequence(module(packed)[0], batch_first=True)
            out.sin().sum().backward()
            outputs.append(out)
        assert outputs[1].device == dev
        same(outputs[1], outputs[0].detach(), exact=False)
        same(x_f.grad, x.grad, exact=False)
        for a, b in zip(lstm_f.parameters(), lstm.parameters()):
            same(a.grad, b.grad, exact=False)

    @check
    def bf16_matmul_and_embedding():
        torch.manual_seed(0)
        a, b = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)
        same(a.to(dev) @ b.to(dev), a @ b)
        emb = torch.nn.Embedding(10, 4)
        emb_f = __import__("copy").deepcopy(emb).to(dev)
        idx = torch.tensor([[1, 2, 2], [9, 0, 1]])
        emb(idx).sum().backward()
        emb_f(idx.to(dev)).sum().backward()
        same(emb_f.weight.grad, emb.weight.grad)

    @check
    def sparse_embedding_grad_is_unsupported():
        emb = torch.nn.Embedding(10, 4, sparse=True).to(dev)
        try:
            emb(torch.tensor([1, 2], device=dev)).sum().backward()
        except (RuntimeError, NotImplementedError):
            return
        raise AssertionError("sparse gradients on fakegpu unexpectedly worked; update the docs")

    @check
    def views_alias_storage():
        flat = torch.zeros(10, device=dev)
        piece = flat.narrow(0, 2, 3)
        piece.fill_(7.0)
        assert flat.cpu().tolist() == [0, 0, 7, 7, 7, 0, 0, 0, 0, 0]
        assert piece.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert piece.data_ptr() == flat.data_ptr() + 2 * 4
        m = torch.arange(12.0, device=dev).view(3, 4)
        m.t()[1, 2] = -1.0  # transpose write-through
        m[:, 3] *= 10  # slicing write-through
        m.as_strided((2,), (5,), 1).zero_()
        want = torch.arange(12.0).view(3, 4)
        want.t()[1, 2] = -1.0
        want[:, 3] *= 10
        want.as_strided((2,), (5,), 1).zero_()
        same(m, want)
        # what DeepSpeed ZeRO does: parameters become views of one flat buffer
        p = torch.nn.Parameter(torch.ones(3, device=dev))
        buf = torch.arange(8.0, device=dev)
        p.data = buf.narrow(0, 4, 3)
        buf.mul_(2)
        assert p.tolist() == [8.0, 10.0, 12.0] and p.device == dev

    @check
    def inplace_resize_set_empty():
        x = torch.zeros(2, device=dev)
        x.add_(1).mul_(3)
        assert x.tolist() == [3.0, 3.0] and x.sum().item() == 6.0
        x.resize_(5)
        x[2:].fill_(1)
        assert x.shape == (5,) and x.tolist() == [3.0, 3.0, 1.0, 1.0, 1.0]
        e = torch.empty(0, device=dev)
        assert e.device == dev and e.numel() == 0
        src = torch.arange(6.0, device=dev)
        y = torch.empty(0, device=dev)
        y.set_(src.untyped_storage(), 2, (2, 2))
        assert y.tolist() == [[2.0, 3.0], [4.0, 5.0]]
        src[2] = 9.0
        assert y[0, 0].item() == 9.0
        out = torch.empty(0, device=dev)
        torch.add(src, 1, out=out)  # out= resize
        assert out.device == dev and out.tolist() == [1.0, 2.0, 10.0, 4.0, 5.0, 6.0]
        z = torch.arange(4, device=dev)
        z.untyped_storage().resize_(0)  # what ZeRO-3 does to free a gathered parameter
        assert z.untyped_storage().size() == 0

    @check
    def device_moves_and_serialization():
        import io

        x = torch.randn(3, 4)
        f = x.to(dev)
        assert f.device == dev and f.is_fakegpu and not f.is_cpu
        assert torch.equal(f.cpu(), x) and torch.equal(f.to("cpu"), x)
        g = f.to(torch.device(fakegpu.DEVICE_TYPE, 1))
        assert g.device.index == 1 and torch.equal(g.cpu(), x)
        assert f.tolist() == x.tolist() and f[0, 0].item() == x[0, 0].item()
        buf = io.BytesIO()
        torch.save({"a": f, "b": f.cpu()}, buf)
        buf.seek(0)
        back = torch.load(buf)
        assert back["a"].device == dev and torch.equal(back["a"].cpu(), x) and back["b"].device.type == "cpu"

    @check
    def default_device_is_cpu():
        torch.nn.Linear(2, 2).to(dev)
        assert torch.tensor(1.0).device.type == "cpu"
        assert torch.zeros(3).device.type == "cpu"
        assert torch.zeros(3, device=fakegpu.DEVICE_TYPE).device == dev

    @check
    def mixed_device_ops_fail_like_cuda():
        f = torch.ones(3, device=dev)
        for bad in (lambda: f + torch.ones(3), lambda: torch.cat([f, torch.ones(3)]),
                    lambda: torch.ones(3) * f, lambda: f.mul_(torch.ones(3)),
                    lambda: f + torch.ones(3, device=torch.device(fakegpu.DEVICE_TYPE, 1))):
            try:
                bad()
            except RuntimeError as e:
                assert "Expected all tensors to be on the same device" in str(e), e
                assert "fakegpu:0" in str(e), e
            else:
                raise AssertionError("mixed-device op did not fail")
        # allowed as on CUDA: 0-dim CPU tensors, copies, indexing with CPU indices
        assert (f * torch.tensor(2.0)).tolist() == [2.0, 2.0, 2.0]
        f.copy_(torch.arange(3.0))
        assert f[torch.tensor([2, 0])].tolist() == [2.0, 0.0]
        f[torch.tensor([1])] = torch.tensor(5.0)
        assert f.tolist() == [0.0, 5.0, 2.0]

    @check
    def cpu_generator_fails_like_cuda():
        f = torch.empty(4, device=dev)
        gen = torch.Generator()
        for bad in (lambda: f.normal_(generator=gen), lambda: f.uniform_(generator=gen),
                    lambda: f.bernoulli_(0.5, generator=gen),
                    lambda: torch.randperm(5, device=dev, generator=gen)):
            try:
                bad()
            except RuntimeError as e:
                assert "Expected a 'fakegpu' device type for generator but found 'cpu'" in str(e), e
            else:
                raise AssertionError("CPU generator accepted for a fakegpu op")
        g = torch.Generator(device=dev).manual_seed(7)
        a = f.normal_(generator=g).cpu()
        b = torch.empty(4).normal_(generator=torch.Generator().manual_seed(7))
        assert torch.equal(a, b)

    @check
    def guard_streams_and_device_module():
        mod = torch.fakegpu
        assert mod.is_available() and mod.device_count() == fakegpu.device_count() >= 2
        assert mod.current_device() == 0
        with mod.device(1):
            assert mod.current_device() == 1
            assert torch.empty(1, device=fakegpu.DEVICE_TYPE).device.index == 1
        assert mod.current_device() == 0
        s = mod.current_stream()
        assert s.device == dev and s.stream_id == 0
        e1, e2 = torch.Event(device=fakegpu.DEVICE_TYPE, enable_timing=True), torch.Event(device=fakegpu.DEVICE_TYPE, enable_timing=True)
        e1.record()
        e2.record()
        e2.synchronize()
        assert e1.query() and e1.elapsed_time(e2) >= 0
        mod.synchronize()
        assert torch._C._get_accelerator().type == fakegpu.DEVICE_TYPE

    @check
    def checkpoint_recomputes():
        from torch.utils.checkpoint import checkpoint

        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        lin_f = __import__("copy").deepcopy(lin).to(dev)
        calls = []

        def block(mod, x):
            calls.append(1)
            return F.dropout(torch.tanh(mod(x)), 0.3, training=True)

        x = torch.randn(4, 8)
        torch.manual_seed(11)
        ref = block(lin, x)
        ref.sum().backward()
        torch.manual_seed(11)
        calls.clear()
        out = checkpoint(block, lin_f, x.to(dev).requires_grad_(), use_reentrant=False)
        out.sum().backward()
        assert len(calls) == 2, calls  # forward + recompute
        same(out, ref.detach())
        same(lin_f.weight.grad, lin.weight.grad)

    @check
    def memory_counted_as_cudas_allocator_reports_it():
        import gc

        gc.collect()
        fake = torch.fakegpu
        base = fake.memory_allocated(dev)
        a = torch.empty(1000, device=dev)  # fakegpu's own allocation
        assert fake.memory_allocated(dev) == base + 4000
        b = a * 2  # a CPU kernel's result, taken over as device memory
        view = b[10:]  # a view: no new storage
        assert fake.memory_allocated(dev) == base + 8000, fake.memory_allocated(dev) - base
        fake.reset_peak_memory_stats(dev)
        c = torch.randn(10000, device=dev)
        del c
        assert fake.max_memory_allocated(dev) == base + 48000 and fake.memory_allocated(dev) == base + 8000
        x = torch.ones(100).to(dev)  # a copy onto the device
        x.resize_(1000)  # grown in place: the old storage's bytes go, the new ones come
        assert fake.memory_allocated(dev) == base + 12000, fake.memory_allocated(dev) - base
        del a, b, view, x
        assert fake.memory_allocated(dev) == base and fake.memory_reserved(dev) == base

    return checks


def _run_single_worker() -> None:
    results = {}
    try:
        checks = _single_checks()
    except Exception:
        print(MARK + json.dumps({"setup": traceback.format_exc()}), flush=True)
        return
    for name, fn in checks.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(MARK + json.dumps(results), flush=True)


SINGLE_CHECKS = ["memory_counted_as_cudas_allocator_reports_it", "mlp_forward_backward_equals_cpu", "dropout_and_rng_follow_cpu", "sdpa_forward_backward", "lstm_forward_backward",
                 "bf16_matmul_and_embedding", "sparse_embedding_grad_is_unsupported", "views_alias_storage",
                 "inplace_resize_set_empty", "device_moves_and_serialization", "default_device_is_cpu",
                 "mixed_device_ops_fail_like_cuda", "cpu_generator_fails_like_cuda",
                 "guard_streams_and_device_module", "checkpoint_recomputes"]


# ============================================================================ multi-process worker
def _ds_run(stage: int) -> dict:
    import deepspeed
    import torch

    torch.manual_seed(1234)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
           "steps_per_print": 10 ** 6, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}

    def build():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = build()
    else:
        model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    losses, info = [], {}
    for _ in range(2):
        x = torch.randn(4, 6, generator=gen).to(engine.device)
        y = torch.randn(4, 3, generator=gen).to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = list(engine.module.parameters())
    info["engine_device"] = str(engine.device)
    info["param_devices"] = sorted({str(p.device) for p in params})
    if stage == 3:
        info["partition_devices"] = sorted({str(p.ds_tensor.device) for p in params})
        info["flat_devices"] = sorted({str(t.device) for t in engine.optimizer.fp32_partitioned_groups_flat})
    else:
        info["flat_devices"] = sorted({str(t.device) for t in engine.optimizer.single_partition_of_fp32_groups})
        info["bit16_flat_devices"] = sorted({str(t.device) for t in engine.optimizer.bit16_groups_flat})
    # the full, gathered weights after the steps (same on every rank)
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        info["weights"] = [p.detach().cpu().flatten().tolist() for p in params]
    info["losses"] = losses
    if hasattr(engine, "destroy"):
        engine.destroy()
    return info


def _collectives(dev) -> dict:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    out = {}

    def both(name, fn):
        """Run fn(device, group) on fakegpu/fakeccl and on cpu/gloo; results must be identical."""
        a = [t.cpu() for t in fn(dev, None)]
        b = fn(torch.device("cpu"), gloo)
        out[name] = all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
        out[name + "_device"] = str(fn(dev, None)[0].device)

    def data(device, n=6, seed=0):
        g = torch.Generator().manual_seed(seed + 10 * rank)
        return torch.randn(n, generator=g).to(device)

    def all_reduce(device, group):
        t = data(device)
        dist.all_reduce(t, group=group)
        return [t]

    def all_gather(device, group):
        t = data(device)
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        return parts

    def broadcast(device, group):
        t = data(device)
        dist.broadcast(t, src=1, group=group)
        return [t]

    def reduce_scatter_tensor(device, group):
        t = data(device, n=4 * world)
        o = torch.empty(4, device=device)
        dist.reduce_scatter_tensor(o, t, group=group)
        return [o]

    def all_gather_into_tensor(device, group):
        t = data(device, n=3)
        o = torch.empty(3 * world, device=device)
        dist.all_gather_into_tensor(o, t, group=group)
        return [o]

    def send_recv(device, group):
        t = data(device, n=5)
        if rank == 0:
            dist.send(t, dst=1, group=group)
        else:
            dist.recv(t, src=0, group=group)
        return [t]

    def async_all_reduce_views(device, group):
        flat = data(device, n=8)
        view = flat.narrow(0, 2, 4)  # a collective on a view writes through to the flat buffer
        dist.all_reduce(view, group=group, async_op=True).wait()
        return [flat]

    for fn in (all_reduce, all_gather, broadcast, reduce_scatter_tensor, all_gather_into_tensor, send_recv,
               async_all_reduce_views):
        both(fn.__name__, fn)
    dist.barrier()
    sub = dist.new_group([0, 1])
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t, group=sub)
    out["subgroup"] = t.tolist() == [3.0, 3.0, 3.0] and dist.get_backend(sub) == "fakeccl"
    try:
        dist.all_reduce(torch.ones(1))
        out["cpu_tensor_error"] = None
    except Exception as e:  # noqa: BLE001
        out["cpu_tensor_error"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_gather_into_tensor(torch.empty(2 * world, device=dev), torch.ones(2), group=sub)
        out["mixed_collective_error"] = None
    except Exception as e:  # noqa: BLE001
        out["mixed_collective_error"] = f"{type(e).__name__}: {e}"
    return out


def _run_dist_worker(mode: str) -> None:
    import torch

    import time

    from pretrain.distributed.internals import without_shared_memory_comm

    local_rank = int(os.environ["LOCAL_RANK"])
    res = {}
    t0 = time.monotonic()

    def stamp(what):
        print(f"[{time.monotonic() - t0:6.2f}s] {what}", flush=True)

    if mode == "fake":
        import fakegpu

        fakegpu.enable()
        stamp("enabled")
        fakegpu.set_device(local_rank)
        import deepspeed

        from deepspeed.accelerator import get_accelerator

        res["accelerator"] = [get_accelerator().device_name(), get_accelerator().communication_backend_name(),
                              get_accelerator().current_device_name()]
        with without_shared_memory_comm():  # as init_parallel starts it
            deepspeed.init_distributed(dist_backend=fakegpu.BACKEND)
        stamp("init")
        res["backend"] = torch.distributed.get_backend()
        res["collectives"] = _collectives(torch.device(fakegpu.DEVICE_TYPE, local_rank))
        stamp("collectives")
    else:
        import deepspeed

        with without_shared_memory_comm():  # as init_parallel starts it: no inference op compiled
            deepspeed.init_distributed(dist_backend="gloo")
    for stage in (1, 3):
        res[f"zero{stage}"] = _ds_run(stage)
        stamp(f"zero{stage}")
    print(MARK + json.dumps(res), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ============================================================================ pytest side
def _env():
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("FAKEGPU_NO_DEEPSPEED", None)
    return env


@pytest.fixture(scope="module")
def single():
    proc = subprocess.run([sys.executable, str(HERE), "single"], cwd=REPO, env=dict(_env(), FAKEGPU_NO_DEEPSPEED="1"),
                          capture_output=True, text=True, timeout=600)
    res = _result(proc.stdout + proc.stderr)
    assert "setup" not in res, res["setup"]
    return res


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE_CHECKS)
def test_single_process(single, name):
    assert single.get(name) == "ok", single.get(name, f"check {name} did not run")


@pytest.fixture(scope="module")
def dist_runs(single):  # after `single`, so the extension is built once before the ranks start
    from distributed import run_ranks

    results, errors = {}, []

    def job(mode):
        try:
            procs = run_ranks([str(HERE), "dist", mode], nprocs=2, timeout=300, env={"FAKEGPU_DEVICE_COUNT": "4"})
            results[mode] = [_result(p.stdout) for p in procs]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=job, args=(mode,)) for mode in ("fake", "cpu")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.slow
def test_fakeccl_collectives_equal_gloo(dist_runs):
    for rank, res in enumerate(dist_runs["fake"]):
        assert res["backend"] == "fakeccl"
        col = res["collectives"]
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor",
                     "send_recv", "async_all_reduce_views"):
            assert col[name] is True, (rank, name, col)
            assert col[name + "_device"] == f"fakegpu:{rank}", (rank, name, col)
        assert col["subgroup"] is True


@pytest.mark.slow
def test_cpu_tensor_in_collective_fails_like_nccl(dist_runs):
    for res in dist_runs["fake"]:
        err = res["collectives"]["cpu_tensor_error"]
        assert err is not None, "all_reduce of a CPU tensor on a fakeccl group succeeded"
        assert NO_CPU_BACKEND in err, err
        # a CPU input next to a fakegpu output reaches fakeccl itself, which refuses it
        err = res["collectives"]["mixed_collective_error"]
        assert err is not None and "only accepts tensors on fakegpu" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_zero_on_fakegpu_matches_cpu(dist_runs, stage):
    for rank, (fake, cpu) in enumerate(zip(dist_runs["fake"], dist_runs["cpu"])):
        assert fake["accelerator"] == ["fakegpu", "fakeccl", f"fakegpu:{rank}"]
        f, c = fake[f"zero{stage}"], cpu[f"zero{stage}"]
        want = f"fakegpu:{rank}"
        assert f["engine_device"] == want, f
        assert f["param_devices"] == [want], f
        assert f["flat_devices"] == [want], f
        if stage == 3:
            assert f["partition_devices"] == [want], f
        else:
            assert f["bit16_flat_devices"] == [want], f
        assert c["param_devices"] == ["cpu"], c
        assert len(f["losses"]) == 2
        assert f["losses"] == pytest.approx(c["losses"], rel=0, abs=1e-6), (f["losses"], c["losses"])
        for wf, wc in zip(f["weights"], c["weights"]):
            assert wf == pytest.approx(wc, rel=0, abs=1e-6)


if __name__ == "__main__":
    if sys.argv[1] == "single":
        _run_single_worker()
    elif sys.argv[1] == "dist":
        _run_dist_worker(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
