"""Right after the trainer builds its DeepSpeed engine, the optimizer has taken no step and the
tensors it steps (fp32 masters) equal the model's weights, for every precision x ZeRO stage.

DeepSpeed's FP16_UnfusedOptimizer (bf16 at ZeRO-0, and fp16) steps the client optimizer once
with zero gradients from its constructor; with decoupled weight decay that shrank every weight
(LAMB: by 1 - lr) before training began.
"""
import json

import pytest

from distributed import gpu_env, run_ranks

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("engines") / "engines.json"
    run_ranks(["tests/_engine_worker.py", str(out)], 1, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_no_step_at_construction(engines, precision, stage, optimizer):
    result = engines[f"{precision}-zero{stage}-{optimizer}"]
    assert result["model_dtypes"] == [f"torch.{PRECISION_DTYPES[precision]}"], result  # the precision took effect
    assert result["optimizer_states"] == 0, f"the optimizer stepped during engine construction ({result['wrapper']})"
    assert result["max_relative_difference"] == 0.0, f"fp32 masters differ from the model ({result['wrapper']})"


FP16_DEVICES = {"fakegpu": {"BERT_FAKE_GPU": "1"}, "cuda": gpu_env(BERT_FAKE_GPU="0")}


@pytest.fixture(scope="module")
def fp16_engines(tmp_path_factory):
    cache = {}

    def get(device_type):
        if device_type not in cache:
            out = tmp_path_factory.mktemp(f"fp16-engines-{device_type}") / "engines.json"
            run_ranks(["tests/_engine_worker.py", str(out), "fp16"], 1, timeout=600, env=FP16_DEVICES[device_type])
            cache[device_type] = json.loads(out.read_text())
        return cache[device_type]

    return get


@pytest.mark.parametrize("device_type", ["fakegpu", pytest.param("cuda", marks=pytest.mark.gpu(1))])
@pytest.mark.parametrize("stage", [1, 2, 3])  # fp16 at ZeRO-0 is refused (pretrain/config/precision.py)
@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_fp16_takes_no_step_at_construction(fp16_engines, device_type, stage, optimizer):
    """fp16 needs a device with fp16 (DeepSpeed has no CPU fp16): the CPU test mode's, and a GPU."""
    engines = fp16_engines(device_type)
    result = engines[f"fp16-zero{stage}-{optimizer}"]
    assert engines["device"] == f"{device_type}:0"
    assert result["model_dtypes"] == ["torch.float16"], result
    assert result["optimizer_states"] == 0, f"the optimizer stepped during engine construction ({result['wrapper']})"
    assert result["max_relative_difference"] == 0.0, f"fp32 masters differ from the model ({result['wrapper']})"


def test_wrappers_took_effect(engines):
    """The cases above cover the wrappers they name (bf16 ZeRO-0 is the one that stepped)."""
    assert engines["bf16-zero0-lamb"]["wrapper"] == "FP16_UnfusedOptimizer"
    assert engines["bf16-zero1-lamb"]["wrapper"] == "BF16_Optimizer"  # fp32 gradient accumulation
    assert engines["bf16-zero2-lamb"]["wrapper"] == "DeepSpeedZeroOptimizer"
    assert engines["fp32-zero3-adamw"]["wrapper"] == "DeepSpeedZeroOptimizer_Stage3"
    assert engines["fp32-zero0-lamb"]["wrapper"] == "Lamb"


def test_fp16_loss_scale_is_read_from_every_wrapper(engines):
    """FP16_UnfusedOptimizer (fp16 at ZeRO-0) has no `cur_scale`; the scale comes from `loss_scale`."""
    assert engines["fp16"] == {"loss_scale": 1024.0, "has_cur_scale": False}


def test_fine_tuning_takes_no_step_at_construction(tmp_path):
    """The same guard in fine-tuning: bf16 at ZeRO-0 gets FP16_UnfusedOptimizer there too."""
    from test_finetune_tasks import QUIET, repeat_task, tiny_bert

    hf = tiny_bert(tmp_path)
    files = repeat_task(tmp_path, train=64, dev=16)
    out = tmp_path / "engine.json"
    run_ranks(["tests/_finetune_engine_worker.py", str(out), "rte", *QUIET, f"model.init_from={hf}",
               f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]", "task.max_seq_length=12",
               "train.precision=bf16", "train.grad_accum_dtype=bf16", f"train.output_dir={tmp_path / 'out'}"], 1,
              timeout=300)
    assert json.loads(out.read_text()) == {"wrapper": "FP16_UnfusedOptimizer", "optimizer_states": 0}
