"""The planner's fast parts: the parameters it reads off the model, the layouts it weighs (the
trainer's own validation), its step-time model, and tools/plan.py's table and pick. Its memory
predictions against real engines are in tests/test_memory_plan.py."""
import dataclasses
import json
from pathlib import Path

import pytest

from pretrain.config import load_config
from pretrain.plan.layouts import Layout, candidate_layouts, shapes_only
from pretrain.plan.shapes import stage_parameters
from pretrain.plan.step_time import Hardware, predict_step_time

REPO = Path(__file__).resolve().parents[1]

LARGE_PHASE2 = "configs/bert-large-phase2.yaml"
A100 = Hardware(gpus_per_node=8, flops={"bf16": 156e12, "fp16": 156e12, "fp32": 78e12},
                intra_node_bandwidth=150e9, inter_node_bandwidth=25e9)


@pytest.mark.parametrize("config", ["configs/bert-base.yaml", pytest.param("configs/bert-large.yaml", marks=pytest.mark.slow)])
def test_parameters_are_hugging_faces_plus_the_vocabulary_padding(config):
    """Independent reference: transformers' BertForPreTraining of the same shape holds every
    parameter ours does, less the padded vocabulary rows (embedding and decoder bias)."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    cfg = load_config(config)
    m = cfg.model
    with torch.device("meta"):  # shapes only: 110M (340M) parameters never allocated nor initialised
        hf = BertForPreTraining(BertConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                           num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                                           intermediate_size=m.ffn_size, max_position_embeddings=m.max_position_embeddings,
                                           type_vocab_size=m.type_vocab_size))
    hf_numel = sum(p.numel() for p in hf.parameters())  # the decoder weight is tied: counted once
    padding = m.padded_vocab_size(1) - m.vocab_size
    (whole,) = stage_parameters(cfg, 1, 1)
    assert whole.numel == hf_numel + padding * (m.hidden_size + 1)
    assert whole.tensors == len(list(hf.parameters()))

    # TP2: every sharded tensor halves (vocabulary padded to 128 x 2), the replicated ones stay
    (tp2,) = stage_parameters(cfg, 2, 1)
    h, f, layers, vocab2 = m.hidden_size, m.ffn_size, m.num_layers, m.padded_vocab_size(2)
    sharded = layers * (4 * h * h + 3 * h + 2 * h * f + f) + vocab2 * h + vocab2  # Q/K/V/O, MLP, biases, vocab
    assert tp2.numel == whole.numel + (vocab2 - m.padded_vocab_size(1)) * (h + 1) - sharded // 2


def test_pipeline_stages_are_deepspeeds_cut():
    """Stages as DeepSpeed's type:TransformerLayer partition makes them: equal layers, the
    embeddings on the first, the heads and the tied decoder on the last (the word embedding on
    both), and together every parameter once plus the second copy of the tied embedding."""
    cfg = load_config("configs/bert-large.yaml")
    (whole,) = stage_parameters(cfg, 1, 1)
    stages = stage_parameters(cfg, 1, 4)
    assert [s.transformer_layers for s in stages] == [6, 6, 6, 6]
    assert [(s.first, s.last) for s in stages] == [(True, False), (False, False), (False, False), (False, True)]
    embedding = cfg.model.padded_vocab_size(1) * cfg.model.hidden_size
    assert sum(s.numel for s in stages) == whole.numel + embedding
    assert stages[1].numel == stages[2].numel < min(stages[0].numel, stages[3].numel)


def test_layouts_are_what_the_trainer_accepts():
    cfg = load_config(LARGE_PHASE2)
    layouts, refused = candidate_layouts(cfg, 64, 8)
    assert layouts and all(l.gpus == 64 and l.tp <= 8 for l in layouts)
    for layout in layouts[::97]:
        run = layout.apply(cfg)
        shapes_only(run).validate(world_size=64)
        assert (run.parallel.tensor_parallel, run.parallel.pipeline_parallel, run.train.micro_batch_size) == \
               (layout.tp, layout.pp, layout.micro_batch)
    assert not any(l.pp > 1 and l.zero > 1 for l in layouts)
    assert not any(l.zero == 0 and l.precision != "fp32" for l in layouts)
    assert {l.pp for l in layouts} == {1, 2, 4, 8}  # divide both the 24 layers and the 64 devices
    reasons = " ".join(refused)
    assert "cannot be combined with pipeline parallelism" in reasons and "must be divisible by" in reasons
    assert cfg.parallel.tensor_parallel == 1  # the user's config is not modified


def test_step_time_model():
    cfg = load_config(LARGE_PHASE2)

    def time(tp=1, pp=1, dp=64, zero=1, micro=8, recompute="none", precision="bf16", hw=A100):
        layout = Layout(tp, pp, dp, zero, micro, recompute, precision)
        stages = [s.numel for s in stage_parameters(cfg, tp, pp)]
        return predict_step_time(layout.apply(cfg), layout, hw, stages, 4)

    flops_only = dataclasses.replace(A100, memory_bandwidth=float("inf"), optimizer_bandwidth=float("inf"))
    base = time(hw=flops_only)
    assert base.tp == base.pp == base.bubble == base.optimizer == 0 and base.dp > 0
    # the compute of 2048 samples of BERT-large at 512 over 64 devices at 156 TFLOP/s
    h, f = 1024, 4096
    flops = 2048 * 3 * 24 * (512 * (8 * h * h + 4 * h * f) + 4 * 512**2 * h) / 64  # the heads add ~2%
    assert base.compute == pytest.approx(flops / 156e12, rel=0.05)
    assert time(recompute="full", hw=flops_only).compute == pytest.approx(4 / 3 * base.compute, rel=0.05)
    assert base.compute < time(recompute="selective").compute < time(recompute="full").compute
    assert time(precision="fp32", hw=flops_only).compute == pytest.approx(2 * base.compute)
    assert time(zero=2).dp > time(zero=1).dp and time(zero=3).dp > time(zero=2).dp
    # the optimizer steps 1/DP of the elements from ZeRO-1 on
    assert time(zero=0, precision="fp32").optimizer == pytest.approx(64 * time(zero=1).optimizer)
    tp2 = time(tp=2, dp=32, hw=flops_only)
    assert tp2.tp > 0 and tp2.compute == pytest.approx(base.compute, rel=0.02)  # the same matrix products per device
    # ... but LayerNorms, dropouts and residuals are replicated over TP: more element-wise work per device
    assert time(tp=2, dp=32).compute > time().compute
    pp4 = time(pp=4, dp=16, hw=flops_only)
    micro_batches = 2048 // (8 * 16)
    assert pp4.bubble == pytest.approx(3 / micro_batches * pp4.compute) and pp4.pp > 0
    # a DP group that leaves the node pays the network's bandwidth
    one_node = time(dp=8, micro=8, hw=A100)
    assert one_node.dp < base.dp


def test_plan_tool_picks_a_fitting_layout(capsys):
    from tools.plan import main

    assert main(["--config", LARGE_PHASE2, "--gpus", "64", "--device-memory", "6GB", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "refused by the trainer's config rules" in out
    pick = out.splitlines()[-1].split()
    assert "parallel.tensor_parallel=" in pick[0] and "train.precision=bf16" in pick

    assert main(["--config", LARGE_PHASE2, "--gpus", "64", "--device-memory", "6GB", "--precision", "bf16",
                 "--json", "--zero", "1", "--recompute", "none"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["zero"] == 1 and r["recompute"] == "none" for r in rows)
    times = [r["step_seconds"]["total"] for r in fitting]
    assert times == sorted(times)
    usable = (6 - 2) * 2**30  # --device-memory 6GB less --reserve 2GB: GiB both
    assert all(r["memory_bytes"]["total"] <= usable for r in fitting)
    assert all(r["memory_bytes"]["total"] > usable and "GiB usable" in r["why_not"] for r in rows if not r["fits"])
    assert any(not r["fits"] for r in rows)


def test_plan_tool_says_when_nothing_fits(capsys):
    from tools.plan import main

    assert main(["--config", LARGE_PHASE2, "--gpus", "8", "--device-memory", "1GB", "--reserve", "0.5GB"]) == 1
    assert "no layout fits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--config", LARGE_PHASE2, "--gpus", "12", "--device-memory", "40GB"])
    assert exit_.value.code == 2


# ----------------------------------------------------------------------------- tools/plan.py's arguments
GiB = 2**30


@pytest.mark.parametrize("text", ["80G", "80GB", "80 GiB", "80 gb", "81920MiB", "81920 M", "0.078125TB", "80g"])
def test_memory_sizes_read_as_users_mean_them(text):
    """A GPU's "80GB" is 80 GiB of memory (nvidia-smi: 81,559-81,920 MiB): G, GB and GiB all
    mean 2^30 bytes, as nvidia-smi's MiB and torch.cuda.mem_get_info's bytes users compare with."""
    from tools.plan import size

    assert size(text) == 80 * GiB


def test_bandwidths_are_decimal_as_vendors_quote_them():
    from tools.plan import bandwidth

    assert bandwidth("150GB/s") == bandwidth("150 GB/s") == bandwidth("150G/s") == 150e9
    assert bandwidth("1.5TB/s") == 1.5e12 and bandwidth("100GiB/s") == 100 * GiB


def usage_error(capsys, argv) -> str:
    """The stderr of a usage error (exit 2), which must be one line."""
    from tools.plan import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "[-h]" not in err, err  # no usage dump
    return err.strip()


@pytest.mark.parametrize("argv, message", [
    (["--device-memory", "80"], "argument --device-memory: '80' has no unit: write e.g. 80GB (G, GB and GiB all "
                                "mean 2^30 bytes, as nvidia-smi's MiB are 2^20)"),
    (["--device-memory", "80GB", "--reserve", "2"], "argument --reserve: '2' has no unit: write e.g. 2GB"),
    (["--device-memory", "80 gigs"], "argument --device-memory: '80 gigs': unknown unit 'gigs' (B, K, M, G, T; "
                                     "G, GB and GiB alike)"),
    (["--device-memory", "80GB", "--inter-node-bandwidth", "200Gb/s"],
     "argument --inter-node-bandwidth: '200Gb/s': a lower-case b is bits; give bytes per second (200 Gb/s = 25GB/s)"),
    (["--device-memory", "80GB", "--memory-bandwidth", "2000"], "argument --memory-bandwidth: '2000' has no unit"),
    (["--device-memory", "2GB", "--reserve", "2GB"], "--reserve (2.0 GiB) must be less than --device-memory (2.0 GiB)"),
    (["--device-memory", "80GB", "--zero", "4"], "argument --zero: '4': choose from 0, 1, 2, 3"),
])
def test_a_bad_argument_is_one_line_naming_it(capsys, argv, message):
    err = usage_error(capsys, ["--config", "configs/bert-tiny.yaml", "--gpus", "1", *argv])
    assert err.startswith(f"python tools/plan.py: error: {message}"), err
    assert err.endswith("(usage: python tools/plan.py --help)")


def test_a_missing_argument_is_one_line(capsys):
    assert "the following arguments are required: --gpus, --device-memory" in usage_error(
        capsys, ["--config", "configs/bert-tiny.yaml"])


def test_the_plan_says_what_it_does_not_model(capsys):
    from tools.plan import main

    small = ["--config", "configs/bert-tiny.yaml", "--gpus", "1", "--precision", "fp32", "--zero", "0",
             "--recompute", "none", "--micro-batch", "8"]
    assert main([*small, "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "1 devices (1 per node) of 80.0 GiB, 78.0 GiB usable each" in out  # 80GB is 80 GiB, 2GB reserve 2 GiB
    assert ("not modelled: padding and data.packing (every micro-batch is predicted as full rows of "
            "data.seq_length); CPU offload (offload_optimizer, offload_param); evaluation") in out
    assert ("BERT (no context parallelism) computes real tokens only: its memory and step time are predicted for "
            "full rows of data.seq_length (an upper bound") in out
    assert "this config packs" not in out
    context = ["--config", "configs/bert-tiny.yaml", "--gpus", "2", *small[4:]]  # BERT's rows under CP
    assert main([*context, "--device-memory", "80GB", "data.packing=true", "parallel.context_parallel=2"]) == 0
    out = capsys.readouterr().out
    assert ("this config packs samples (data.packing=true): its memory and step time are predicted for padded rows; "
            "GPUs also keep a [rows, 1, seq, seq] attention mask per layer") in out
    modern = ["--config", "configs/modernbert-tiny.yaml", *small[2:]]
    assert main([*modern, "--device-memory", "80GB"]) == 0
    assert ("ModernBERT computes real tokens only: its memory and step time are predicted for full rows of "
            "data.seq_length (an upper bound") in capsys.readouterr().out


def measured_config(step):
    """tools/gpu/bench.py's padded run of a calibration measurement (bf16, ZeRO-1, one micro-batch,
    LAMB eager: the measurements predate optimizer.fused)."""
    return load_config(str(REPO / "configs" / f"bert-{step.model}.yaml"), [
        f"train.global_batch_size={step.batch}", f"train.micro_batch_size={step.batch}", "train.precision=bf16",
        "parallel.zero_stage=1", f"optimizer.name={step.optimizer}", "optimizer.fused=false",
        f"data.seq_length={step.seq}", f"data.max_predictions_per_seq={-(-step.seq * 15 // 100)}"])


@pytest.mark.slow  # eight configs loaded and a grid searched: about a second
def test_step_time_calibrated_against_the_gpu():
    """BERT's shares (pretrain/plan/calibration.py) are the fit to the H100's AdamW steps, and they
    predict every measured step, LAMB's too (its extra bytes), within 10%, where the previous
    shares (0.7 of the peak, element-wise at the full bandwidth) were 11-33% fast."""
    from pretrain.plan import calibration as cal

    steps = [(measured_config(step), step.step_s) for step in cal.MEASURED]
    adamw = [pair for pair, step in zip(steps, cal.MEASURED) if step.optimizer == "adamw"]
    fitted = cal.fit(adamw, cal.H100_CEILINGS)
    assert (fitted.matrix_products, fitted.elementwise) == (cal.BERT.matrix_products, cal.BERT.elementwise)
    assert cal.calibration_for("bert") is cal.BERT
    for (cfg, measured), step in zip(steps, cal.MEASURED):
        predicted = cal.predicted_step(cfg, cal.H100_CEILINGS, cal.BERT)
        assert predicted == pytest.approx(measured, rel=0.10), (step, predicted)
    old = cal.predicted_step(steps[-1][0], cal.H100_CEILINGS, cal.Calibration(0.7, 1.0, ""))
    assert old < 0.75 * steps[-1][1]  # BERT-base seq 512 with LAMB: what the old model missed most
