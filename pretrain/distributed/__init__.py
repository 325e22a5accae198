"""Running on many processes: the launch environment and the process groups (parallel.py), where
tensors live and every collective of ours (device.py: a CPU tensor handed to an NCCL group is
refused by name), joining a job across nodes (rendezvous.py), a free port for a job started here (ports.py), and every private DeepSpeed or
megatron-core attribute the project touches, pinned in one module (internals.py)."""
