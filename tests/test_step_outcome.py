"""What becomes of a step (pretrain/optim/guard.py `classify`): every combination of what the ranks
found non-finite, whether DeepSpeed's wrapper skipped the step itself, and fp16's loss scaler.
Also how a non-finite step is traced (the line naming the ranks that saw it first) and when a rank
is named as the device to suspect. The runs behind it, in every precision x ZeRO stage x layout:
tests/test_precision_matrix.py."""
import pytest

from pretrain.optim.guard import (APPLIED, AT_MIN_SCALE, NonFiniteSource, StepOutcome, classify, describe_nonfinite,
                                  suspect_ranks)
from pretrain.optim.skips import NonFiniteTraining, SkipPolicy


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


def _source(rank, loss=False, gradients=True, parameters=("bert.pooler.dense.weight",), more=0):
    return NonFiniteSource(rank, f"node-{rank}", f"cuda:{rank}", loss, gradients, tuple(parameters), more)


def test_a_traced_step_names_the_ranks_their_device_and_parameters():
    outcome = StepOutcome(True, ("gradients", "loss"), counts=True,
                          sources=(_source(1, loss=True, parameters=["a", "b"], more=3), _source(3)))
    assert describe_nonfinite(12, outcome) == (
        "step 12: non-finite gradients and loss, seen first by rank 1 (host node-1, cuda:1): loss and gradients "
        "(a, b and 3 more); rank 3 (host node-3, cuda:3): gradients (bert.pooler.dense.weight)")
    untraced = StepOutcome(True, ("gradients",), counts=True)
    assert "no rank saw a non-finite value before the reduction" in describe_nonfinite(3, untraced)


def test_the_suspect_is_the_rank_that_alone_saw_every_bad_step():
    one, zero = (_source(1),), (_source(0),)
    assert [s.rank for s in suspect_ranks([one, one], world_size=4)] == [1]
    assert suspect_ranks([one], world_size=4) == []  # once proves nothing
    assert suspect_ranks([one, zero], world_size=4) == []  # two ranks, one step each: no pattern
    assert suspect_ranks([one, one + zero], world_size=4) == []  # another rank saw one of them too
    assert suspect_ranks([one, ()], world_size=4) == []  # a step no rank saw before the reduction
    everyone = (_source(0), _source(1))
    assert suspect_ranks([everyone, everyone], world_size=2) == []  # every rank: the run diverged


def test_the_stop_message_names_the_suspect_device():
    policy = SkipPolicy(max_consecutive=2, world_size=2)
    bad = StepOutcome(True, ("gradients",), counts=True, sources=(_source(1),))
    policy.count(5, bad, 32)
    with pytest.raises(NonFiniteTraining) as error:
        policy.count(6, bad, 40)
    assert ("rank 1 (host node-1, cuda:1) saw every one of them before the reduction and no other rank did: "
            "suspect that device") in str(error.value)
