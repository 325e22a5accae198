"""The memory and step-time planner (tools/plan.py): for a config on N devices, every layout the
trainer accepts, each rank's memory predicted from the model definition and DeepSpeed's rules,
and the layouts ranked by predicted step time.

- shapes.py: each pipeline stage's parameters, read off the model built on the meta device;
- layouts.py: the layouts (TP x PP x DP, ZeRO, micro-batch, recompute, precision), validated;
- states.py: parameters, gradients, optimizer state and DeepSpeed's buffers per rank;
- activations.py: what autograd saves per layer, by recompute mode and device kernels;
- memory.py: a rank's whole prediction (the trainer logs it beside the measured memory);
- step_time.py: FLOPs and communication per step over a device's rate and bandwidths;
- planner.py: every layout predicted and ranked.
"""
from .memory import MemoryPrediction, predict_rank_memory

__all__ = ["MemoryPrediction", "predict_rank_memory"]
