"""Asynchronous checkpoint saves (checkpoint.async_save, pretrain/checkpoint/async_save.py).

In this process: a snapshot is a copy (the original changed afterwards, the file still holds what
it was) and torch.save of it writes the bytes torch.save of the original would have; two ranks'
background saves agreeing through a real TCPStore publish only once every rank's files are
written, tell every rank one failure and the step to raise it at, and name a rank that never
reports; the planner's host memory of a save's snapshot.

Multi-process (tests/_async_save_worker.py, marker slow):
- one 2-rank job runs fp32 and bf16 x ZeRO 0-3 at DP2 and ZeRO 0-1 at PP2 (DeepSpeed's pipeline
  refuses ZeRO-2/3; bf16 ZeRO-0 is refused at PP2) each synchronously and asynchronously, the async
  run's step-2 writes held until step 4 has finished: every async checkpoint holds the bytes of the
  synchronous one of its step (ZeRO-3's optimizer files: their contents, DeepSpeed numbers its param
  groups with a per-process counter), written off the main thread; resuming it repeats the
  synchronous steps; every rank's snapshot size is what the planner predicts;
- SIGKILL of the rank whose background save is held leaves `latest` on the previous checkpoint
  (the other rank's files written but never published), and the relaunch resumes from it, exact;
- SIGTERM while a background save is held: the stop waits for it, publishes it and its own, exit 0;
- `python -m pretrain` with async saves: the snapshot's memory logged, the last save published
  before the exit; a file damaged afterwards refused at the resume, named; a full disk (a tmpfs,
  root only, as tests/test_disk_full.py) fails the job with one line naming the save.
"""
import json
import os
import signal
import subprocess
import threading
import time
from collections import OrderedDict, namedtuple
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from distributed import free_port, REPO, run_python, run_ranks, start_python
from _train_worker import TINY

ZERO3 = "train.deepspeed_config=tests/zero3-partition-everything.json"


# ----------------------------------------------------------------------------- the snapshot
Fragment = namedtuple("Fragment", "start numel")  # as DeepSpeed's fragment addresses in a ZeRO state dict


def state_like_deepspeeds():
    """Views of one flat buffer (ZeRO's flat groups), a parameter, optimizer state with a Python step
    counter, a namedtuple, a bf16 tensor. (No set: any copy of one may iterate in another order,
    which pickles differently; DeepSpeed's state dicts hold none.)"""
    flat = torch.randn(100)
    param = torch.nn.Parameter(torch.randn(3, 4))
    return flat, {
        "module": OrderedDict(weight=flat[:50].view(5, 10), bias=flat[50:60], param=param.detach()),
        "optimizer": {"state": {0: {"exp_avg": torch.randn(4), "step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "mapping": Fragment(1, torch.ones(2, dtype=torch.bfloat16)), "names": ("a", "b"), "counter": torch.tensor(5)}


def test_a_snapshot_is_a_copy_that_saves_as_the_original_did(tmp_path):
    from pretrain.checkpoint.async_save import Snapshot

    flat, state = state_like_deepspeeds()
    (tmp_path / "then").mkdir()
    (tmp_path / "later").mkdir()
    torch.save(state, tmp_path / "then" / "f.pt")  # what a synchronous save writes at this moment
    snapshot = Snapshot(state)
    assert snapshot.nbytes >= (100 + 12 + 4 + 1) * 4  # the flat buffer once, however many views
    # training goes on: weights, moments, counters and param groups change in place
    flat.mul_(3)
    state["optimizer"]["state"][0]["exp_avg"].add_(1)
    state["optimizer"]["state"][0]["step"] = 4
    state["optimizer"]["param_groups"][0]["lr"] = 0.05
    state["counter"].add_(1)
    torch.save(snapshot.restore(), tmp_path / "later" / "f.pt")
    assert (tmp_path / "later" / "f.pt").read_bytes() == (tmp_path / "then" / "f.pt").read_bytes()
    restored = snapshot.restore()
    assert restored["module"]["weight"].untyped_storage().data_ptr() == restored["module"]["bias"].untyped_storage().data_ptr()
    assert restored["module"]["weight"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- agreement over the store
class Ranks:
    """Two ranks' BackgroundSaves of one save into tmp_path/iter_0000002.partial, agreeing through a
    TCPStore this test serves; rank 1's write can be held (`hold`) or fail (`fail`)."""

    def __init__(self, tmp_path, fail=None, timeout=30.0, hold=None):
        import torch.distributed as dist
        from datetime import timedelta

        from pretrain.checkpoint.async_save import BackgroundSave, FileWrite, SaveStore, Snapshot

        port = free_port()
        self.server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))
        self.staging = tmp_path / "iter_0000002.partial"
        self.staging.mkdir()
        self.published = []
        self.step = 10

        def write(rank):
            def save(obj, path):
                if rank == 1 and hold is not None:
                    hold.wait(30)
                if rank == 1 and fail is not None:
                    raise fail
                torch.save(obj, path)
            return save

        self.saves = [BackgroundSave(
            str(self.staging), 2, [FileWrite(str(self.staging / f"r{rank}.pt"), Snapshot({"x": torch.arange(3) + rank}),
                                             write(rank))],
            [], rank, 2, SaveStore(("127.0.0.1", port)), "series/iter_0000002/id", timeout,
            self.published.append if rank == 0 else None, lambda: self.step) for rank in (0, 1)]

    def start(self, ranks=(0, 1)):
        for rank in ranks:
            self.saves[rank].start()
        return self

    def join(self):
        for save in self.saves:
            save.join()


def test_rank_0_publishes_only_once_every_rank_is_durable(tmp_path):
    from pretrain.checkpoint.format import crc32s

    held = threading.Event()
    ranks = Ranks(tmp_path, hold=held).start()
    time.sleep(1.0)
    assert (tmp_path / "iter_0000002.partial" / "r0.pt").exists()  # rank 0's part is written...
    assert not ranks.saves[0].finished and ranks.published == []  # ...and waits for rank 1's
    held.set()
    ranks.join()
    assert [s.error for s in ranks.saves] == [None, None]
    paths = [str(ranks.staging / name) for name in ("r0.pt", "r1.pt")]
    assert ranks.published == [{os.path.basename(p): crc for p, crc in crc32s(paths).items()}]


def test_a_failure_on_one_rank_reaches_every_rank_with_the_step_to_raise_it(tmp_path):
    ranks = Ranks(tmp_path, fail=OSError(28, "No space left on device")).start()
    ranks.join()
    assert ranks.published == []
    errors = [save.error for save in ranks.saves]
    assert all(type(e).__name__ == "DiskFullError" for e in errors), errors
    assert str(errors[0]) == str(errors[1]) and str(ranks.staging) in str(errors[0])
    assert "no space left on device while writing the checkpoint of step 2" in str(errors[0])
    assert [save.raise_at for save in ranks.saves] == [12, 12]  # rank 0 was at step 10
    assert [save.failure_due(11) for save in ranks.saves] == [None, None]
    assert [save.failure_due(12) for save in ranks.saves] == errors


def test_a_rank_that_never_reports_is_named_after_the_timeout(tmp_path):
    ranks = Ranks(tmp_path, timeout=1.0).start(ranks=(0,))  # rank 1 never writes (a frozen rank)
    ranks.saves[0].join()
    assert ranks.published == []
    assert "rank(s) 1 did not finish writing their files of the checkpoint of step 2 within " \
           "resilience.save_timeout_minutes" in str(ranks.saves[0].error)


# ----------------------------------------------------------------------------- the plan
def test_the_plan_counts_a_saves_snapshot_as_host_memory(capsys):
    from pretrain.config import load_config
    from pretrain.plan.memory import predict_rank_memory
    from tools import plan

    overrides = TINY + ["parallel.zero_stage=1", "checkpoint.async_save=true"]
    cfg = load_config(None, overrides)
    first, second = (predict_rank_memory(cfg, 2, 0, "cpu", dp_rank) for dp_rank in (0, 1))
    # data-parallel rank 0 writes the model states, every rank its optimizer partition (masters, moments)
    assert first.checkpoint_snapshot == first.parameters + first.optimizer_state
    assert second.checkpoint_snapshot == second.optimizer_state
    assert first.total == predict_rank_memory(load_config(None, overrides[:-1]), 2, 0, "cpu").total  # not the device's
    assert predict_rank_memory(load_config(None, overrides[:-1]), 2, 0, "cpu").checkpoint_snapshot == 0
    zero0 = load_config(None, TINY + ["parallel.zero_stage=0", "checkpoint.async_save=true"])
    assert predict_rank_memory(zero0, 2, 0, "cpu", 1).checkpoint_snapshot == 0  # only rank 0 writes at ZeRO-0

    assert plan.main(["--config", "configs/bert-base.yaml", "--gpus", "8", "--device-memory", "80GB",
                      "checkpoint.async_save=true"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint.async_save: a save's snapshot takes " in out and " GiB of host (CPU) memory" in out
    plan.main(["--config", "configs/bert-base.yaml", "--gpus", "8", "--device-memory", "80GB", "--json",
               "checkpoint.async_save=true"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(row["host_bytes"]["checkpoint_snapshot"] > 0 for row in rows)


# ----------------------------------------------------------------------------- the matrix (2 ranks)
WORLDS = {"dp2": (1, 1), "pp2": (1, 2)}


def configs() -> list[dict]:
    found = []
    for world, (tp, pp) in WORLDS.items():
        for precision in ("fp32", "bf16"):
            for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                if (precision, zero, world) == ("bf16", 0, "pp2"):
                    continue  # refused: DeepSpeed cannot resume a bf16 pipeline at ZeRO-0
                overrides = [f"train.precision={precision}", f"parallel.zero_stage={zero}"]
                overrides += [ZERO3] if zero == 3 else []
                overrides += ["train.grad_accum_dtype=bf16"] if precision == "bf16" and zero == 0 else []
                found.append({"name": f"{world}-{precision}-zero{zero}", "tp": tp, "pp": pp, "overrides": overrides})
    return found


CONFIGS = {c["name"]: c for c in configs()}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("async-matrix") / "out.json"
    run_ranks(["tests/_async_save_worker.py", str(out), "matrix", *map(json.dumps, CONFIGS.values())], 2, timeout=900)
    return json.loads(out.read_text())


def tensors_equal(a, b, where="") -> list[str]:
    """Where two loaded checkpoint files differ: tensors bitwise, everything else by value, except
    ZeRO-3's param-group ids (ds_id: a counter of DeepSpeed's that runs on across engines in one process)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a if k != "ds_id" for d in tensors_equal(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tensors_equal(x, y, f"{where}[{i}]")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [f"{where}: tensors differ"]
    return [] if repr(a) == repr(b) else [f"{where}: {a!r} != {b!r}"]


def assert_same_checkpoint(sync_dir, async_dir, tag, sync_crcs, async_crcs):
    assert sorted(sync_crcs) == sorted(async_crcs), (tag, sorted(sync_crcs), sorted(async_crcs))
    for name in sync_crcs:
        if sync_crcs[name] == async_crcs[name]:
            continue  # the same bytes
        assert "optim_states" in name and "zero" in name, f"{tag}/{name} has other bytes than the synchronous save's"
        a, b = (torch.load(os.path.join(d, tag, name), weights_only=False, map_location="cpu") for d in (sync_dir, async_dir))
        differences = tensors_equal(a, b)
        assert not differences, (tag, name, differences[:5])


def assert_same_steps(got, expected, rel=1e-6):
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        for key in ("loss", "lm_loss", "nsp_loss", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=rel, abs=0.0), f"step {step} of {len(got)}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_async_saves_hold_the_synchronous_bytes_and_resume_exactly(matrix, name):
    from pretrain.checkpoint.format import verify_checkpoint
    from test_precision_matrix import expected_wrapper

    result = matrix[name]
    sync, asynchronous, resumed = result["sync"], result["async"], result["resumed"]
    precision, zero = name.split("-")[1], int(name[-1])
    pipelined = CONFIGS[name]["pp"] > 1
    # the configuration took effect
    assert asynchronous["wrapper"] == sync["wrapper"] == expected_wrapper(precision, zero, pipelined)
    assert asynchronous["stages"] == (2 if pipelined else 1)
    # the async run's step-2 files were written after step 4 had finished, off the main thread
    assert all(held for held in asynchronous["held"]), asynchronous["held"]
    assert all(not main for rank in asynchronous["writes"] for main, _ in rank) and all(asynchronous["writes"])
    assert all(main for rank in sync["writes"] for main, _ in rank)
    # the same checkpoints as the synchronous saves (so, the state of their step), complete and checked
    assert sorted(asynchronous["fingerprints"]) == sorted(sync["fingerprints"]) == ["iter_0000002", "iter_0000004"]
    for tag in sync["fingerprints"]:
        assert_same_checkpoint(result["dirs"]["sync"], result["dirs"]["async"], tag, sync["fingerprints"][tag],
                               asynchronous["fingerprints"][tag])
        verify_checkpoint(os.path.join(result["dirs"]["async"], tag), contents=True)
    # saving in the background changed nothing in training; the resume repeats steps 3-4
    assert_same_steps(asynchronous["history"], sync["history"], rel=0.0)
    assert_same_steps(resumed["history"], sync["history"][2:4])
    assert resumed["params_norm"] == pytest.approx(sync["params_norm"], rel=1e-6)
    # every rank's snapshot is what the planner predicts: its files' tensors, plus 18-37 KiB here (the
    # RNG states, DeepSpeed's config and bookkeeping, the pickles)
    for measured, planned in zip(asynchronous["snapshot_bytes"], asynchronous["planned_snapshot_bytes"]):
        assert 0 <= measured - planned <= 48 << 10, (asynchronous["snapshot_bytes"], asynchronous["planned_snapshot_bytes"])


# ----------------------------------------------------------------------------- kills and signals (2 ranks)
COMMON = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "optimizer.name=lamb", "parallel.zero_stage=1",
          "train.train_steps=1000", "resilience.dist_timeout_minutes=0.5", "data.num_workers=0"]


class Job:
    """world ranks of tests/_async_save_worker.py (train mode), each rank's output in tmp_path/<name>.rank<R>.log."""

    def __init__(self, tmp_path, name, overrides, world=2, env=None):
        self.out = tmp_path / f"{name}.json"
        self.logs = [tmp_path / f"{name}.rank{rank}.log" for rank in range(world)]
        port = free_port()
        self.procs = []
        for rank in range(world):
            rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO),
                            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
            with open(self.logs[rank], "w") as log:
                self.procs.append(start_python(["tests/_async_save_worker.py", str(self.out), "train", *COMMON,
                                                *overrides], rank_env, output=log))

    def log(self, rank=0) -> str:
        return self.logs[rank].read_text()

    def dump(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}) ---\n{self.log(r)[-3000:]}" for r, p in enumerate(self.procs))

    def wait_for(self, text, rank=0, timeout=300, poll=0.1):
        deadline = time.monotonic() + timeout
        while text not in self.log(rank):
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs), self.dump()
            time.sleep(poll)

    def wait(self, timeout=300) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ranks still running after {timeout}s:\n{self.dump()}") from None
        finally:
            self.kill()

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def result(self, timeout=300) -> dict:
        codes = self.wait(timeout)
        assert codes == [0] * len(codes), self.dump()
        return json.loads(self.out.read_text())


def complete(tag_dir) -> dict:
    """meta.json lists exactly the files of the directory, at their sizes."""
    meta = json.loads((tag_dir / "meta.json").read_text())
    on_disk = {str(p.relative_to(tag_dir)): p.stat().st_size for p in tag_dir.rglob("*")
               if p.is_file() and p.name != "meta.json"}
    assert meta["files"] == on_disk
    return meta


def iter_dirs(save_dir) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.is_dir() and p.name.startswith("iter_"))


@pytest.mark.slow
def test_sigkill_during_a_background_save_keeps_latest_and_the_relaunch_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    saving = ["checkpoint.save_interval=4", f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}",
              "checkpoint.async_save=true"]
    with ThreadPoolExecutor(2) as pool:  # the reference runs beside the crashing job (2 cores, half busy each)
        straight = pool.submit(lambda: Job(tmp_path, "straight", ["resilience.exit_after_steps=8"]).result())
        # rank 1's background writes of step 8's save wait for a file that never comes; rank 0's go on
        crashed = Job(tmp_path, "crashed", saving + ["resilience.exit_after_steps=12"],
                      env={"ASYNC_SAVE_HOLD": f"8:1:{tmp_path / 'never'}"})
        try:
            crashed.wait_for("holding the background write", rank=1)
            # training went on past the save, to the last step, whose stop waits for the held save on
            # every rank: the kill comes during that wait (it once waited out the save timeout there)
            crashed.wait_for("step 12/")
            partial = ckpt / "iter_0000008.partial"
            ours = {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank00000.pt"}
            deadline = time.monotonic() + 60
            while not ours <= {p.name for p in partial.iterdir()}:
                assert time.monotonic() < deadline, sorted(p.name for p in partial.iterdir())
                time.sleep(0.1)
            # rank 0's files are written and durable, rank 1's are not: nothing is published
            assert (ckpt / "latest").read_text() == "iter_0000004"
            assert not (partial / "meta.json").exists() and not (partial / "rng_rank00001.pt").exists()
            time.sleep(0.5)
            crashed.procs[1].send_signal(signal.SIGKILL)
            codes = crashed.wait(timeout=60)
        finally:
            crashed.kill()
        straight = straight.result()
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, crashed.dump()
    assert (ckpt / "latest").read_text() == "iter_0000004"
    assert iter_dirs(ckpt) == ["iter_0000004", "iter_0000008.partial"]

    resumed = Job(tmp_path, "resumed", saving + ["resilience.exit_after_steps=4"])
    second = resumed.result()
    assert f"resumed from {ckpt} at step 4 (32 samples)" in resumed.log()
    assert_same_steps(second["history"], straight["history"][4:8])
    assert second["params_norm"] == pytest.approx(straight["params_norm"], rel=1e-6)
    # the relaunch's save of step 8 replaced the leftover
    assert iter_dirs(ckpt) == ["iter_0000004", "iter_0000008"] and (ckpt / "latest").read_text() == "iter_0000008"
    complete(ckpt / "iter_0000008")


@pytest.mark.slow
def test_sigterm_during_a_background_save_publishes_it_and_exits_0(tmp_path):
    ckpt = tmp_path / "ckpt"
    release = tmp_path / "release"
    job = Job(tmp_path, "stopped", ["checkpoint.save_interval=3", f"checkpoint.save_dir={ckpt}",
                                    "checkpoint.async_save=true", "resilience.stop_check_interval=1"],
              env={"ASYNC_SAVE_HOLD": f"3:1:{release}"})
    try:
        job.wait_for("holding the background write", rank=1, poll=0.02)
        job.procs[1].send_signal(signal.SIGTERM)  # not the logging rank, while step 3's save is in flight
        time.sleep(2.0)
        # the stop (or step 6's save, if it came first) waits for the save in flight: nothing is
        # published yet, nobody exited
        assert not (ckpt / "latest").exists() and iter_dirs(ckpt) == ["iter_0000003.partial"]
        assert all(p.poll() is None for p in job.procs), job.dump()
        release.write_text("")
        result = job.result()
    finally:
        job.kill()
    log = job.log()
    stopped_at = int(log.split("SIGTERM received: saving at step ")[1].split()[0])
    assert 4 <= stopped_at <= 7 and len(result["history"]) == stopped_at
    stop = f"iter_{stopped_at:07d}"
    assert log.index(f"saved checkpoint {ckpt}/iter_0000003") < log.index(f"saved checkpoint {ckpt}/{stop}")
    assert (ckpt / "latest").read_text() == stop
    assert iter_dirs(ckpt) == sorted({"iter_0000003", stop} | ({"iter_0000006"} if stopped_at == 7 else set()))
    for tag in ("iter_0000003", stop):
        assert {"rng_rank00000.pt", "rng_rank00001.pt"} <= set(complete(ckpt / tag)["files"])


# ----------------------------------------------------------------------------- the program (1 rank)
def pretrain(tmp, overrides) -> subprocess.CompletedProcess:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return run_python(["-m", "pretrain", "--config", "configs/bert-tiny.yaml", *TINY, *COMMON,
                       "checkpoint.async_save=true", *overrides], env, timeout=300)


@pytest.mark.slow
def test_the_program_saves_in_the_background_and_a_damaged_file_is_refused_at_the_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = pretrain(tmp_path, [f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2",
                               "resilience.exit_after_steps=3"])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "checkpoint.async_save: the snapshot of a save holds " in output
    # the end of training waited for its save (step 3) to be published
    assert (ckpt / "latest").read_text() == "iter_0000003" and iter_dirs(ckpt) == ["iter_0000002", "iter_0000003"]
    complete(ckpt / "iter_0000003")

    damaged = ckpt / "iter_0000003" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte, the size kept
    damaged.write_bytes(bytes(data))
    done = pretrain(tmp_path, [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}",
                               "resilience.exit_after_steps=1"])
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{damaged} has other bytes than when it was saved" in errors[0], output
    assert "step 1/" not in done.stdout


@pytest.mark.slow
def test_a_background_save_on_a_full_disk_ends_the_job_naming_the_save(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0:  # root-only, as tests/test_disk_full.py
        if os.environ.get("REQUIRE_NETNS", "0") not in ("", "0"):
            pytest.fail(f"mount -t tmpfs failed: {mounted.stderr.strip()}, and REQUIRE_NETNS=1")
        pytest.skip(f"mount -t tmpfs failed (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        stats = os.statvfs(mount)
        with open(mount / "filler", "wb") as f:
            f.write(b"\0" * (stats.f_bavail * stats.f_frsize - (64 << 10)))
        done = pretrain(tmp_path, [f"checkpoint.save_dir={mount / 'ckpt'}", "checkpoint.save_interval=1",
                                   "resilience.exit_after_steps=4"])
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    staging = mount / "ckpt" / "iter_0000001.partial"
    assert len(errors) == 1 and errors[0].startswith(f"error: {staging}: no space left on device while writing "
                                                     "the checkpoint of step 1"), output[-3000:]
    assert "; this save is never loaded; `latest` is unchanged" in errors[0] and "Traceback" not in output
    assert "step 3/" not in done.stdout  # at the next step boundary, or the next save's wait
