"""Rank entry point (TP = world size): dropout masks under tensor parallelism.

usage: python tests/_dropout_worker.py OUT.json
Checks, with dropout 0.3 in training mode:
- replicated regions (embedding output, every layer's output) are identical on all TP ranks;
- the model-parallel stream (attention dropout of local heads) differs between TP ranks;
- recomputation replays the same masks: with full (each layer) and selective (the attention
  core only) recomputation the gradients equal those without it, and the attention core really
  runs again in backward (calls counted).
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()  # the known noise only: anything new shows up in the test run

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pretrain.config import ModelConfig  # noqa: E402
from pretrain.data.samples.batches import collate, split_inputs_labels  # noqa: E402
from pretrain.data.samples.synthetic import SyntheticDataset  # noqa: E402
from pretrain.model.bert import PretrainingLoss, build_model, init_weights  # noqa: E402
import pretrain.model.layers as layers  # noqa: E402
from pretrain.model.layers import EmbeddingTail, TransformerLayer  # noqa: E402
from pretrain.model.rng import RngTracker, seed_streams  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402


def max_spread_over_tp(tensor, group, size):
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return max((p - pieces[0]).abs().max().item() for p in pieces)


def main():
    out_path = sys.argv[1]
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    par = init_parallel(launch, int(os.environ["WORLD_SIZE"]), 1)
    cfg = ModelConfig(vocab_size=250, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
                      max_position_embeddings=64, hidden_dropout=0.3, attention_dropout=0.3)
    padded = cfg.padded_vocab_size(par.tp_size)
    tracker = RngTracker(par.device)
    seed_streams(tracker, 11, par.tp_rank, 0, 0)
    model = build_model(cfg, padded, torch.float32, tracker, par.tp_group)
    init_weights(model, cfg, 11, par.tp_rank, par.tp_size)
    model.train()
    loss_fn = PretrainingLoss(par.tp_group, par.tp_rank)
    data = SyntheticDataset(cfg.vocab_size, 32, 5, 100, seed=3)
    inputs, labels = split_inputs_labels(collate([data[i] for i in range(4)]), par.device)

    captured = []
    hooks = [m.register_forward_hook(lambda mod, args, out: captured.append(out[0].detach()))
             for m in model.modules() if isinstance(m, (EmbeddingTail, TransformerLayer))]

    def forward_backward():
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), labels).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    start = (torch.get_rng_state(), tracker.state_dict())
    grads_plain = forward_backward()
    replicated_spread = max(max_spread_over_tp(h, par.tp_group, par.tp_size) for h in captured)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        model.eval()
        eval_out = model(inputs)[0]
        model.train()
        train_out = model(inputs)[0]
    dropout_changes_output = (eval_out - train_out).abs().max().item()

    calls = []
    attention = layers.packed_attention  # the training forward's attention (real tokens, per document)

    def counted_attention(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return attention(*args, **kwargs)

    layers.packed_attention = counted_attention
    recomputed = {}
    for mode in ("none", "selective", "full"):
        torch.set_rng_state(start[0])
        tracker.load_state_dict(start[1])
        for layer in model.modules():
            if isinstance(layer, TransformerLayer):
                layer.recompute = mode
        calls.clear()
        grads = forward_backward()
        recomputed[mode] = {"grad_diff": max((grads_plain[n] - grads[n]).abs().max().item() for n in grads_plain),
                            "attention_calls": len(calls)}
    layers.packed_attention = attention
    grad_scale = max(g.abs().max().item() for g in grads_plain.values())

    with tracker.fork():
        draw = torch.rand(16)
    stream_spread = max_spread_over_tp(draw, par.tp_group, par.tp_size)

    if par.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"replicated_spread": replicated_spread, "captured": len(captured),
                       "dropout_changes_output": dropout_changes_output, "stream_spread": stream_spread,
                       "recomputed": recomputed, "grad_scale": grad_scale}, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
