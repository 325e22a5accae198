"""The step-time model's shares of a device's measured ceilings, fitted to GPU measurements.

The model (step_time.py) prices a step's matrix products at the device's matrix-product peak and
its element-wise work and optimizer step at its memory bandwidth. No kernel reaches either ceiling:
`Calibration` holds the shares the measured steps show, per model family. They are fitted to the
runs in `MEASURED` (tools/gpu/bench.py on one H100, its own measured ceilings beside them: the
best bf16 `torch.mm` and a device copy): one matrix-product share and one element-wise share for
all of a family's runs (a grid search for the smallest worst-case error over the AdamW runs, whose
optimizer step is one fused kernel), the optimizer step counted by its bytes (OPTIMIZER_BYTES) at
the full bandwidth. tests/test_plan.py re-derives the fit and checks every measured step, LAMB's
included, against the prediction.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple


class Calibration(NamedTuple):
    """Shares of the measured ceilings a family's steps reach, and where they come from."""

    matrix_products: float  # of the measured matrix-product peak (the best n^3 torch.mm)
    elementwise: float  # of the measured copy bandwidth, for element-wise work (LayerNorms, dropouts, ...)
    source: str
    # seconds per layer and micro-batch beyond FLOPs and bytes (kernel launches): what makes a small
    # micro-batch slower per sample; kept at the planner's earlier default, not fitted (the measured
    # steps are one large micro-batch each, where it weighs 1-3%)
    layer_overhead: float = 1e-4


class MeasuredStep(NamedTuple):
    """One padded run of tools/gpu/bench.py: model, seq x micro-batch, optimizer, median step (s)."""

    model: str
    seq: int
    batch: int
    optimizer: str  # "adamw" (torch's fused) or "lamb" (eager, before optimizer.fused)
    step_s: float


# One NVIDIA H100 80GB HBM3 (2026-11-26, docs/performance.md): bf16, ZeRO-1, one micro-batch per step
H100_CEILINGS = {"gemm_tflops": 789.0, "copy_gb_per_s": 2973.0}
MEASURED = (
    MeasuredStep("large", 128, 256, "adamw", 0.2086), MeasuredStep("large", 128, 256, "lamb", 0.2235),
    MeasuredStep("large", 512, 32, "adamw", 0.1603), MeasuredStep("large", 512, 32, "lamb", 0.1754),
    MeasuredStep("base", 128, 256, "adamw", 0.0865), MeasuredStep("base", 128, 256, "lamb", 0.0897),
    MeasuredStep("base", 512, 32, "adamw", 0.0656), MeasuredStep("base", 512, 32, "lamb", 0.0710),
)

BERT = Calibration(matrix_products=0.84, elementwise=0.53,
                   source="BERT-base and -large at seq 128 and 512 on one H100 (tools/gpu/bench.py, 2026-11-26): "
                          "8 steps within -8%/+8%")

# The H100's measured ceilings against its datasheet (H100 SXM5: 989 dense bf16 TFLOP/s, 3,350 GB/s),
# to turn the shares into shares of a datasheet figure, what tools/plan.py is given
H100_DATASHEET = {"gemm_tflops": 989.0, "copy_gb_per_s": 3350.0}


def datasheet_shares(calibration: Calibration) -> dict:
    """The shares of a card's datasheet peak and bandwidth: matrix products, element-wise work and
    the optimizer step (the one fused pass the fit assumed at the measured bandwidth)."""
    gemm = H100_CEILINGS["gemm_tflops"] / H100_DATASHEET["gemm_tflops"]
    copy = H100_CEILINGS["copy_gb_per_s"] / H100_DATASHEET["copy_gb_per_s"]
    return {"matrix_products": calibration.matrix_products * gemm, "elementwise": calibration.elementwise * copy,
            "optimizer": copy}


# ModernBERT has no GPU step measured beside the planner yet: it takes BERT's shares.
CALIBRATIONS = {"bert": BERT, "modernbert": BERT}


def calibration_for(architecture: str) -> Calibration:
    """The shares for a model family (model.architecture)."""
    return CALIBRATIONS[architecture]


def hardware(ceilings: dict, calibration: Calibration, precision: str, device_type: str = "cuda"):
    """One device of these measured ceilings (gemm_tflops in `precision`, copy_gb_per_s) at the
    calibration's shares."""
    from .step_time import Hardware

    bandwidth = ceilings["copy_gb_per_s"] * 1e9
    return Hardware(gpus_per_node=1, flops={precision: ceilings["gemm_tflops"] * 1e12 * calibration.matrix_products},
                    intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
                    memory_bandwidth=bandwidth * calibration.elementwise, optimizer_bandwidth=bandwidth,
                    layer_overhead=calibration.layer_overhead, device_type=device_type)


def predict_step(cfg, ceilings: dict, calibration: Calibration, device_type: str = "cuda"):
    """The planner's StepTime of a one-device run of `cfg` (its micro-batch, ZeRO stage, precision)."""
    from .layouts import layout_of
    from .shapes import stage_parameters
    from .step_time import predict_step_time

    grad_bytes = 2 if cfg.train.precision != "fp32" and cfg.train.grad_accum_dtype != "fp32" else 4
    stages = [s.numel for s in stage_parameters(cfg, 1, 1)]
    hw = hardware(ceilings, calibration, cfg.train.precision, device_type)
    return predict_step_time(cfg, layout_of(cfg, 1), hw, stages, grad_bytes)


def predicted_step(cfg, ceilings: dict, calibration: Calibration) -> float:
    """predict_step's total, in seconds."""
    return predict_step(cfg, ceilings, calibration).total


def fit(configs_and_steps, ceilings: dict) -> Calibration:
    """The shares (matrix products 0.50-1.00, element-wise 0.20-1.00, in steps of 0.01) with the
    smallest worst-case |log(predicted / measured)| over (cfg, measured seconds) pairs. A step is
    matrix products / share + element-wise / share + the rest, so each cfg is predicted three times
    and the grid is searched on those terms."""
    terms = []
    for cfg, measured in configs_and_steps:
        whole = predicted_step(cfg, ceilings, Calibration(1.0, 1.0, ""))
        products = whole - predicted_step(cfg, ceilings, Calibration(1e12, 1.0, ""))
        elementwise = whole - predicted_step(cfg, ceilings, Calibration(1.0, 1e12, ""))
        terms.append((products, elementwise, whole - products - elementwise, measured))

    def worst(shares):
        m, e = shares
        return max(abs(math.log((p / m + w / e + rest) / measured)) for p, w, rest, measured in terms)

    grid = itertools.product([i / 100 for i in range(50, 101)], [i / 100 for i in range(20, 101)])
    return Calibration(*min(grid, key=worst), source="fit")
