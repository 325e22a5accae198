"""Training: the pretraining loop (trainer.py) and the parts it calls, each owning its state: the
engine's construction (shared with fine-tuning), the step runner, loaders, evaluator,
checkpointer, step metrics with the throughput window (shared with fine-tuning) and the reporter.
The skip policy lives beside the guard (pretrain/optim/skips.py), stop requests beside the
watchdog (pretrain/resilience/stops.py)."""
