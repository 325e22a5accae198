"""What becomes of a step (pretrain/optim/guard.py `classify`): every combination of what the ranks
found non-finite, whether DeepSpeed's wrapper skipped the step itself, and fp16's loss scaler.
The runs behind it, in every precision x ZeRO stage x layout: tests/test_precision_matrix.py."""
import pytest

from pretrain.optim.guard import APPLIED, AT_MIN_SCALE, StepOutcome, classify


@pytest.mark.parametrize("found,deepspeed_skipped,scaler_can_lower,expected", [
    # nothing non-finite: the step applied, in any precision
    ([], False, None, APPLIED),
    ([], False, True, APPLIED),
    # our check skipped it (ZeRO-0 fp32), or DeepSpeed's did (every other wrapper): counted
    (["loss", "gradients"], False, None, StepOutcome(True, ("gradients", "loss"), counts=True)),
    (["gradients"], True, None, StepOutcome(True, ("gradients",), counts=True)),
    # DeepSpeed saw a non-finite gradient norm where no element was (the norm overflowed)
    ([], True, None, StepOutcome(True, ("gradients",), counts=True)),
    # fp16: gradients overflowed with a finite loss while the scale can still go down: the scaler's skip
    (["gradients"], True, True, StepOutcome(True, ("gradients",), counts=False)),
    # ... at the minimum scale (or a static one) the same overflow is divergence
    (["gradients"], True, False, StepOutcome(True, (AT_MIN_SCALE,), counts=True)),
    # a non-finite loss is never the scaler's business: the forward pass itself overflowed
    (["gradients", "loss"], True, True, StepOutcome(True, ("gradients", "loss"), counts=True)),
])
def test_classify(found, deepspeed_skipped, scaler_can_lower, expected):
    assert classify(found, deepspeed_skipped, scaler_can_lower) == expected


def test_labels():
    assert classify(["gradients"], True, True).label == "fp16 loss-scale overflow"
    assert classify(["loss", "gradients"], True, None).label == "gradients and loss"
    assert APPLIED.label == "" and not APPLIED.skipped
