"""The GPU check kit (tools/gpu/: prepare.sh, check.sh, bench.py), so that it cannot rot between
the rare GPU machines it is for.

- The rehearsal (slow): prepare.sh into a temporary folder for this machine's Python, download
  and wheel builds included; a stand-in for the GPU image (a fresh venv with exactly the packages
  prepare.sh says the image holds, nothing of ours); check.sh on it with the CPU test device
  standing in for the GPU (BERT_FAKE_GPU=1, the test device from its own carried wheel) and a short
  benchmark. It must install ours from the carried wheels only (pip's check of their requirements
  included), run a tier scenario from the kit's copy of the tests, and write the junit XML, the
  benchmark JSON and the summary.
- The benchmark's bookkeeping (fast): the order runs are measured in, the budget's cut, the
  comparisons against Hugging Face's side and NVIDIA's published figure.
"""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from distributed import REPO

sys.path.insert(0, str(REPO / "tools" / "gpu"))
import bench  # noqa: E402  (tools/gpu/bench.py)

LIMIT_MIB = 64


def parse(argv):
    return bench.parse_args(argv)[1]


def test_runs_are_measured_padded_and_hf_first_then_packed_then_the_rest():
    args = parse(["--models", "large,base", "--seqs", "128,512"])
    ids = [job["id"] for job in bench.job_list(args)]
    assert ids[:6] == ["large-s128-ours-zero1", "large-s128-hf", "large-s128-ours-packed",
                       "large-s512-ours-zero1", "large-s512-hf", "large-s512-ours-packed"]
    assert ids[12:14] == ["large-s128-ours-zero0", "large-s128-ours-adamw"]
    assert len(ids) == 20
    assert {job["batch"] for job in bench.job_list(args) if job["seq"] == 512} == {32}  # NVIDIA's batches


def test_by_default_modernbert_base_comes_first_at_its_shapes():
    """The kit's default: ModernBERT-base (the product's first measure) before BERT, at 1024 x 64 and
    8192 x 8, packed first; its four runs at each shape, the BERT ones at NVIDIA's."""
    jobs = bench.job_list(parse([]))
    assert [j["id"] for j in jobs[:8]] == [f"modernbert-base-s{s}-{v}" for s in (1024, 8192)
                                           for v in ("ours-packed", "ours-zero1", "hf", "hf-sparse")]
    assert {(j["seq"], j["batch"]) for j in jobs if j["model"] == "modernbert-base"} == {(1024, 64), (8192, 8)}
    assert {(j["seq"], j["batch"]) for j in jobs if j["model"] == "large"} == {(128, 256), (512, 32)}
    assert not [j for j in jobs if j["model"] != "modernbert-base" and j["variant"] == "hf-sparse"]
    # one --variants list serves both families: each takes the runs it has
    mixed = bench.job_list(parse(["--models", "modernbert-tiny,tiny", "--batch", "32:8",
                                  "--variants", "ours-zero1,hf-sparse,ours-adamw"]))
    assert [j["id"] for j in mixed] == ["modernbert-tiny-s32-ours-zero1", "modernbert-tiny-s32-hf-sparse",
                                        "tiny-s32-ours-zero1", "tiny-s32-ours-adamw"]


def test_the_eager_run_is_on_request_only_and_turns_compilation_off():
    """ours-eager (model.compile=false beside ours-zero1's auto) runs for either family when --variants
    names it, after the main runs; never by default."""
    assert not [j for j in bench.job_list(parse([])) if j["variant"] == "ours-eager"]
    args = parse(["--models", "modernbert-tiny,tiny", "--batch", "32:8", "--variants", "ours-eager,ours-zero1"])
    assert [j["id"] for j in bench.job_list(args)] == ["modernbert-tiny-s32-ours-zero1", "tiny-s32-ours-zero1",
                                                       "modernbert-tiny-s32-ours-eager", "tiny-s32-ours-eager"]
    settings = {"precision": "fp32", "warmup": 1, "steps": 1, "min_fraction": 0.5}
    for job in bench.job_list(args):
        cfg = bench.run_config(job, settings)
        assert cfg.model.compile == ("false" if job["variant"] == "ours-eager" else "auto"), job["id"]
        assert cfg.parallel.zero_stage == 1 and not cfg.data.packing


def test_modernbert_measures_flex_attention_after_the_main_runs():
    """ours-flex (ours-packed with model.attention_kernel=flex, beside auto's kernel: the measurement
    that picks it) is ModernBERT's by default, measured after every model's main runs."""
    ids = [j["id"] for j in bench.job_list(parse(["--models", "modernbert-base,large"]))]
    flex = [i for i in ids if i.endswith("ours-flex")]
    assert flex == ["modernbert-base-s1024-ours-flex", "modernbert-base-s8192-ours-flex"]
    assert ids.index(flex[0]) > ids.index("large-s512-ours-packed")
    job = next(j for j in bench.job_list(parse(["--models", "modernbert-base"])) if j["variant"] == "ours-flex")
    cfg = bench.run_config(job, {"precision": "bf16", "warmup": 1, "steps": 1, "min_fraction": 0.1})
    assert cfg.model.attention_kernel == "flex" and cfg.data.packing


def test_a_spent_budget_records_every_run_as_not_run():
    args = parse(["--models", "tiny", "--seqs", "32", "--batch", "32:4", "--variants", "ours-zero1,hf"])
    calibration, results, _ = bench.run_children(bench.job_list(args), {}, budget_s=0, log=lambda text: None)
    assert calibration is None
    assert {r["status"] for r in results.values()} == {"not run"}
    assert all("budget (0 s)" in r["error"] for r in results.values())


def test_comparisons_against_hf_and_nvidia():
    args = parse(["--models", "large", "--seqs", "128", "--variants", "ours-zero1,hf,ours-packed,ours-eager"])
    jobs = bench.job_list(args)
    measured = {"ours-zero1": (1148.0, 80000.0), "hf": (1000.0, 70000.0), "ours-packed": (1500.0, 120000.0),
                "ours-eager": (1000.0, 64000.0)}
    results = {f"large-s128-{v}": {"status": "ok", "measured": {"sequences_per_s": s, "real_tokens_per_s": t}}
               for v, (s, t) in measured.items()}
    [row] = bench.comparisons(jobs, results)
    assert row["ours_zero1_over_hf"] == pytest.approx(1.148)
    assert row["packed_over_padded_real_tokens"] == pytest.approx(1.5)
    assert row["nvidia_dle_a100_sequences_per_s"] == 574 and row["nvidia_dle_batch"] == 256
    assert row["ours_zero1_over_nvidia_a100"] == pytest.approx(2.0)
    assert row["ours_adamw_over_hf"] is None  # not measured: no ratio made up
    assert row["compiled_over_eager"] == pytest.approx(1.25)
    assert bench.comparison_lines([row], results) == [
        "BERT-large seq 128 B256: ours 1148.0 seq/s on this device, NVIDIA DLE 574 seq/s per A100 80 GB (batch 256); "
        "HF 1000.0",
        "large seq 128: model.compile's kernels 1.25x the eager layers' real tok/s (ours-zero1 / ours-eager)"]


def test_modernbert_comparisons_are_per_real_token():
    args = parse(["--models", "modernbert-base", "--seqs", "1024"])
    measured = {"ours-packed": 400e3, "ours-zero1": 380e3, "hf": 80e3, "hf-sparse": 100e3, "ours-flex": 320e3}
    results = {f"modernbert-base-s1024-{v}": {"status": "ok", "measured": {"sequences_per_s": 1.0,
                                                                             "real_tokens_per_s": t}}
               for v, t in measured.items()}
    [row] = bench.comparisons(bench.job_list(args), results)
    assert row["padded_over_packed_real_tokens"] == pytest.approx(0.95)
    assert row["hf_over_ours_packed_real_tokens"] == pytest.approx(0.2)
    assert row["hf_sparse_over_ours_packed_real_tokens"] == pytest.approx(0.25)
    assert row["auto_kernel_over_flex_real_tokens"] == pytest.approx(1.25)  # the kernel choice (item 5)
    assert row["compiled_over_eager"] is None  # ours-eager not run
    assert "nvidia_dle_a100_sequences_per_s" not in row
    results["modernbert-base-s1024-ours-packed"]["measured"]["attention_kernel"] = "varlen"
    assert bench.comparison_lines([row], results) == [
        "modernbert-base seq 1024 B64 real tok/s: ours packed 400,000, ours padded 380,000, transformers 80,000, "
        "transformers sparse 100,000",
        "modernbert-base seq 1024: attention kernel auto (varlen) 1.25x FlexAttention's real tok/s "
        "(ours-packed / ours-flex)"]


def test_issue_50_targets_are_judged_from_the_runs():
    """The summary's verdict per target: met, not met, or not run (no made-up figure)."""
    def ok(**measured):
        return {"status": "ok", "measured": measured}

    results = {"modernbert-base-s1024-ours-packed": ok(real_tokens_per_s=410e3),
               "modernbert-base-s1024-ours-zero1": ok(real_tokens_per_s=350e3),
               "modernbert-base-s1024-hf": ok(real_tokens_per_s=100e3),
               "large-s128-ours-zero1": ok(sequences_per_s=1500.0, step_s=0.2000),
               "large-s128-ours-adamw": ok(step_s=0.1985), "large-s128-ours-zero0": ok(step_s=0.2100),
               "modernbert-base-s8192-ours-packed": ok(real_tokens_per_s=260e3, first_timed_step_after_s=50.0,
                                                       recompiled_after_step_3=1, max_step_s=0.32, min_step_s=0.30)}
    verdicts = {v["target"].rsplit(" ", 2)[0]: v for v in bench.target_verdicts(results)}
    assert len(verdicts) == len(bench.TARGETS)
    met = {name: v["met"] for name, v in verdicts.items()}
    assert met["ModernBERT-base seq 1024 packed, real tok/s"] is True
    assert met["ModernBERT-base seq 1024 padded / packed, real tok/s"] is False  # 0.85
    hf = verdicts["ModernBERT-base seq 1024 transformers (sdpa) / ours packed"]
    assert hf["measured"] == pytest.approx(100 / 410) and hf["met"] is True
    assert met["ModernBERT-base seq 8192 packed, graphs compiled after step 3"] is False
    assert met["ModernBERT-base seq 8192 packed, slowest / fastest step"] is True  # 1.07
    assert met["BERT-large 128 x 256, LAMB ZeRO-1, seq/s"] is False
    assert verdicts["BERT-large 128 x 256, LAMB step - AdamW step (ms)"]["measured"] == pytest.approx(1.5)
    assert met["BERT-large 128 x 256, bf16 ZeRO-0 / ZeRO-1 step time"] is False
    assert met["BERT-large 512 x 32, LAMB ZeRO-1, seq/s"] is None and met["BERT-large 512 packed, real tok/s"] is None


def test_useful_flops_count_attention_per_document():
    """MFU's numerator: a packed row of two 512-token documents is less work than one of 1,024 tokens
    (its global attention is two 512^2 blocks, not 1024^2), and a padded row counts its real tokens."""
    from pretrain.config import load_config
    from pretrain.model.flops import document_training_flops, encoder_forward_flops

    m = load_config(str(REPO / "configs" / "modernbert-base.yaml"), []).model
    one, two = (document_training_flops(m, lengths, 0, m.vocab_size, False) for lengths in ([1024], [512, 512]))
    assert one == pytest.approx(3 * encoder_forward_flops(m, 1024))
    assert two == pytest.approx(6 * encoder_forward_flops(m, 512)) and two < one
    global_layers = sum(m.is_global_layer(i) for i in range(m.num_layers))
    assert one - two == pytest.approx(3 * global_layers * 4 * m.hidden_size * (1024**2 - 2 * 512**2), rel=0.05)


def test_bad_arguments_are_named():
    for argv, words in ((["--models", "huge"], "unknown model 'huge'"),
                        (["--variants", "ours-zero9"], "unknown variant 'ours-zero9'"),
                        (["--seqs", "256"], "no batch for seq 256")):
        done = subprocess.run([sys.executable, "tools/gpu/bench.py", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and words in done.stderr, done.stderr


def stand_in_image(image, packages: list[str]) -> None:
    """A venv standing in for the GPU image: `packages` and everything they require, linked from this
    environment's own installation (a .pth file names the folder of links) instead of installed again
    (pip took 50 of the rehearsal's 90 s copying torch, scipy and the rest); the few this environment
    lacks (the bench extra's) installed from the index. Nothing of ours: no image package requires it."""
    from importlib import metadata

    from packaging.requirements import Requirement

    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(image)], check=True, timeout=300)
    links, found, missing, todo = image / "linked", {}, [], list(packages)
    links.mkdir()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            found[key] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[key] = None
            missing.append(name)
            continue
        todo += [req.name for req in map(Requirement, dist.requires or [])
                 if req.marker is None or req.marker.evaluate({"extra": ""})]
    assert not {"bert-pretrain", "bert-fakegpu", "deepspeed", "megatron-core"} & set(found), sorted(found)
    for dist in filter(None, found.values()):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if not (links / top).exists():
                (links / top).symlink_to(dist.locate_file(top))
    python = str(image / "bin" / "python")
    site_packages = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    (Path(site_packages) / "_linked.pth").write_text(f"{links}\n")
    if missing:
        installed = subprocess.run([python, "-m", "pip", "install", "-q", *missing], capture_output=True, text=True,
                                   timeout=1200)
        assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]


@pytest.mark.slow
def test_the_kit_is_prepared_installed_and_run_on_the_cpu_test_device(tmp_path):
    kit, image, out = tmp_path / "kit", tmp_path / "image", tmp_path / "out"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    prepared = subprocess.run(["bash", "tools/gpu/prepare.sh", str(kit)], cwd=REPO, capture_output=True, text=True,
                              timeout=900, env=dict(os.environ, GPU_KIT_PYTHON_VERSION=version))
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    wheels = sorted(p.name for p in (kit / "wheels").glob("*.whl"))
    for name in ("bert_pretrain-", "bert_fakegpu-", "deepspeed-", "megatron_core-", "pydantic-", "blingfire-",
                 "seqeval-"):
        assert any(w.startswith(name) for w in wheels), f"no {name}* wheel in {wheels}"
    # the test device travels as its own wheel (the rehearsal's device), not inside ours nor as sources
    kit_tests = kit / "src" / "tests"
    assert (kit_tests / "test_fakegpu.py").exists() and not (kit_tests / "bert-fakegpu").exists()
    for wheel in wheels:
        assert wheel in prepared.stdout, f"prepare.sh does not list {wheel}"
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert size < LIMIT_MIB * 2**20 and f"MiB in all (limit {LIMIT_MIB} MiB)" in prepared.stdout

    # the stand-in image: the image's packages (prepare.sh's list, torch at the version here) and nothing of ours
    stand_in_image(image, (kit / "image-packages.txt").read_text().split())

    # the test device's C++ extension as this environment built it (the same source, the same torch): the
    # kit's own build of it would add about 20 s of compiling to the rehearsal and prove nothing of the kit
    built = subprocess.run([sys.executable, "-c", "import fakegpu; print(fakegpu.enable().__file__)"], cwd=REPO,
                           capture_output=True, text=True, timeout=600, env=dict(os.environ, BERT_FAKE_GPU="1"))
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    env = dict(os.environ, BERT_FAKE_GPU="1", GPU_CHECK_PYTHON=str(image / "bin" / "python"),
               FAKEGPU_EXTENSION=built.stdout.strip().splitlines()[-1],
               GPU_CHECK_BENCH_ARGS="--models modernbert-tiny,tiny --seqs 32 --batch 32:8 --precision fp32 "
                                    "--steps 2 --warmup 1 --variants ours-zero1,hf,ours-packed,hf-sparse")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", str(kit / "check.sh"), str(kit), str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("gpu-check: install: ok (torch ") and "(image, " in summary
    assert "gpu-check: GPU tier: ok: 1 passed, 0 failed, 0 errors, 1 skipped" in summary
    assert "gpu-check: benchmark: ok: 7 ok, 0 failed, 0 not run" in summary and "all parts passed" in summary
    assert "  modernbert-tiny seq 32 B8 real tok/s: ours packed " in summary  # the figures a reader wants first
    assert summary.index("gpu-check: benchmark:") < summary.index("gpu-check: GPU tier:")  # the bench runs first
    assert summary.strip() in done.stdout.strip() or all(line in done.stdout for line in summary.splitlines())

    cases = ET.parse(out / "gpu-tier.xml").getroot().iter("testcase")
    outcomes = {case.get("name"): "skipped" if case.find("skipped") is not None else "passed" for case in cases}
    assert outcomes == {"test_fp16_takes_no_step_at_construction[lamb-1-fakegpu]": "passed",
                        "test_fp16_takes_no_step_at_construction[lamb-1-cuda]": "skipped"}

    report = json.loads((out / "bench.json").read_text())
    assert report["schema"] == bench.SCHEMA and report["device"]["type"] == "fakegpu"
    assert report["calibration"]["gemm_tflops"] > 0 and report["calibration"]["copy_gb_per_s"] > 0
    assert {r["id"]: r["status"] for r in report["runs"]} == {
        **{f"modernbert-tiny-s32-{v}": "ok" for v in ("ours-packed", "ours-zero1", "hf", "hf-sparse")},
        **{f"tiny-s32-{v}": "ok" for v in ("ours-zero1", "hf", "ours-packed")}}
    for run in report["runs"]:
        measured = run["measured"]
        assert measured["parameter_device"] == "fakegpu:0"
        assert measured["sequences_per_s"] > 0 and 0 < measured["real_token_share"] <= 1
        assert measured["peak_memory_gib"] > 0  # the device's allocator, as CUDA's reports it
        assert measured["min_step_s"] <= measured["step_s"] <= measured["max_step_s"]
        # a count after each step: the warmup's, the 2 timed, the profiled one
        assert measured["first_timed_step_after_s"] > 0 and len(measured["compiled_graphs_per_step"]) == 4
        profile = measured["profile"]  # one more step, its time by kind of work
        assert profile["groups_ms"]["gemm"] > 0 and profile["total_ms"] > 0, profile
    modern = {run["variant"]: run["measured"] for run in report["runs"] if run["model"] == "modernbert-tiny"}
    # what each side's attention ran on (the kernel choice is a CUDA one: here attention.py's paths)
    assert modern["ours-packed"]["attention_kernel"] == "attention.py's paths on fakegpu"
    assert modern["hf"]["attention_kernel"] == "transformers' sdpa"
    assert modern["ours-zero1"]["real_token_share"] == 1.0  # padded rows in, real tokens computed
    assert modern["hf"]["real_token_share"] < 1.0  # transformers computes the padding
    runs = {run["variant"]: run for run in report["runs"] if run["model"] == "tiny"}
    # BERT computes real tokens only, padded rows or packed ones
    assert {runs[side]["measured"]["real_token_share"] for side in ("ours-packed", "ours-zero1")} == {1.0}
    planned = runs["ours-zero1"]["planned"]
    assert planned["step_s"] > 0 and planned["memory_gib"] > 0
    assert runs["ours-zero1"]["measured"]["peak_memory_gib"] == pytest.approx(planned["memory_gib"], rel=0.15)
