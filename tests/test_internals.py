"""The DeepSpeed and megatron-core internals we rely on are named in pretrain/distributed/internals.py only,
and each one still exists in the installed versions.

An upgrade that renames `_hp_mapping` or `single_partition_of_fp32_groups` fails here, with the
name and the library module, instead of as an AttributeError (or a silently wrong LAMB layout)
inside a training run. The engines of every wrapper kind are exercised for real by
test_engine_construction.py and test_layout_invariance.py through the same functions.
"""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from pretrain.distributed import internals

REPO = Path(__file__).resolve().parents[1]
# Our own NamedTuples (model.names.ParamName, checkpoint.format.HfParameter) have a field of this
# name; megatron's attribute of the same name is only read next to `tensor_model_parallel`,
# which the scan covers.
SHARED_WITH_OUR_NAMES = {"partition_dim"}


@pytest.mark.parametrize("module", sorted(internals.PINNED))
def test_every_pinned_name_exists_in_the_installed_library(module):
    source = inspect.getsource(importlib.import_module(module))
    missing = [name for name in internals.PINNED[module] if not re.search(rf"\b{re.escape(name)}\b", source)]
    assert not missing, f"{module} no longer mentions {missing}: pretrain/distributed/internals.py must follow the upgrade"


def test_the_wrapper_classes_we_dispatch_on_exist():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        assert callable(getattr(cls, "_forward_impl", None)), f"{cls.__name__}._forward_impl is gone"
    for cls in (BF16_Optimizer, FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer_Stage3, DeepSpeedZeroOptimizer):
        assert inspect.isclass(cls)


def _product_sources():
    for folder in ("pretrain", "finetune", "tools"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path != REPO / "pretrain" / "distributed" / "internals.py":
                yield path


def test_no_other_module_names_an_internal():
    names = sorted({name for names in internals.PINNED.values() for name in names} - SHARED_WITH_OUR_NAMES)
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, names)) + r")\b")
    found = []
    for path in _product_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            match = pattern.search(code)
            if match and not code.lstrip().startswith(('"', "'")):
                found.append(f"{path.relative_to(REPO)}:{number}: .{match.group(1)}")
    assert not found, "DeepSpeed/megatron-core internals outside pretrain/distributed/internals.py:\n" + "\n".join(found)


def test_the_scan_sees_an_internal(tmp_path):
    """The scan above is not vacuous: a line like the ones it forbids is caught."""
    names = sorted({name for names in internals.PINNED.values() for name in names} - SHARED_WITH_OUR_NAMES)
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, names)) + r")\b")
    assert pattern.search("engine._global_grad_norm = norm")
    assert pattern.search("for flat in opt.single_partition_of_fp32_groups:")
    assert not pattern.search('flats = sd["single_partition_of_fp32_groups"]')  # a checkpoint file's key


@pytest.mark.parametrize("weight_device, allreduce_dgrad, route", [
    ("cpu", False, "plain"), ("cpu", True, "plain"),           # the CPU: always one F.linear
    ("meta", False, "plain"),                                  # an accelerator, nothing to overlap
    ("meta", True, "megatron")])                               # an accelerator at TP > 1 (column-parallel)
def test_parallel_linears_take_one_f_linear_unless_megatron_overlaps_a_reduction(one_rank, weight_device,
                                                                                  allreduce_dgrad, route):
    """PlainGemmOverride's routing, on megatron's own _forward_impl arguments: the meta device stands
    in for an accelerator (megatron's function runs there too); the route shows in the output's
    autograd node (megatron's autograd function, or F.linear's addmm)."""
    from pretrain.model.layers import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        linear = cls.__new__(cls)  # _forward_impl reads nothing of the module
        x = torch.ones(2, 3, 4, device=weight_device, requires_grad=True)
        weight = torch.ones(5, 4, device=weight_device, requires_grad=True)
        bias = torch.ones(5, device=weight_device, requires_grad=True)
        out = linear._forward_impl(input=x, weight=weight, bias=bias, gradient_accumulation_fusion=False,
                                   allreduce_dgrad=allreduce_dgrad, sequence_parallel=False,
                                   grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=one_rank)
        node = type(out.grad_fn).__name__
        assert ("LinearWithGradAccumulation" in node) == (route == "megatron"), (cls.__name__, node)
        assert out.shape == (2, 3, 5) and out.device.type == weight_device
