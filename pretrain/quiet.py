"""Warnings the libraries print once per rank (or per step) that say nothing about the run."""
import warnings


def hide_library_warnings() -> None:
    # megatron-core warns on import, once per rank, that optional GPU kernels are missing.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    # DeepSpeed's ZeRO calls a torch collective that torch 2.13 deprecated, once per rank and step.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor. is deprecated", category=FutureWarning)
