"""Warnings the libraries print once per rank (or per step) that say nothing about the run.

The one list of warnings we hide, each with its reason; everything else stays visible. The
programs apply it at start-up, the test workers too, and the test session adds the same list
to pytest's filters (tests/conftest.py), so a new deprecation in torch, DeepSpeed or
megatron-core shows up in the test output instead of vanishing under a blanket ignore.
"""
import contextlib
import io
import logging
import re
import sys
import warnings

# (message regex, category, why it is noise); no ":" in a regex (pytest's filter lines are
# colon-separated), "." stands for it
LIBRARY_NOISE = [
    ("Transformer Engine and Apex are not installed", UserWarning,
     "megatron-core, on import, once per rank: optional GPU kernels are missing; we use none of them"),
    (".*all_gather_into_tensor. is deprecated", FutureWarning,
     "DeepSpeed's ZeRO calls a collective torch 2.13 deprecated, once per rank and step"),
    (".*reduce_scatter_tensor. is deprecated", FutureWarning,
     "the same for ZeRO-2/3's gradient reduce-scatter"),
    (".torch.jit.script_method. is deprecated", DeprecationWarning,
     "torch's own torch/utils/mkldnn.py, on import (through torch._inductor), once per process"),
    ("The following imports from .dynamic_context.py. will be removed", DeprecationWarning,
     "megatron-core's inference package warns about its own imports when megatron.core is imported"),
    ("c10d..broadcast_. an autograd kernel was not registered", UserWarning,
     "raised in the backward pass of DeepSpeed's pipeline engine, which broadcasts tensors that require grad "
     "(tied weights, gloo p2p); every pipeline layout equals one process exactly (tests/test_layout_invariance.py)"),
]


# Log records and printed lines of the libraries that say nothing about the run: (logger or
# "stdout", message regex, why it is noise)
LIBRARY_LOG_NOISE = [
    ("DeepSpeed", "Setting accelerator to CPU", "DeepSpeed on import, once per process, on a machine without GPUs: "
     "the device each rank uses is logged by the trainer (`N rank(s) on cpu ...`)"),
    ("stdout", r"DeepSpeed deepspeed\.ops\.comm\.\w+ built successfully", "DeepSpeed's CPU communication op, "
     "printed by every rank when its process group starts"),
    ("DeepSpeed", r"\*+ You are using ZeRO with an untested optimizer", "DeepSpeed, once per engine at ZeRO >= 1, for "
     "any client optimizer it does not list (our LAMB, torch's AdamW): what ZeRO does with them is tested here "
     "against one process (tests/test_precision_matrix.py, tests/test_layout_invariance.py)"),
]


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def hide_library_warnings() -> None:
    """The warnings above, and the log records of LIBRARY_LOG_NOISE (install before the library
    logs them: DeepSpeed's accelerator line comes on import)."""
    for message, category, _ in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    for logger, message, _ in LIBRARY_LOG_NOISE:
        if logger != "stdout" and not any(isinstance(f, _DropMatching) and f.pattern.pattern == message
                                          for f in logging.getLogger(logger).filters):
            logging.getLogger(logger).addFilter(_DropMatching(message))


@contextlib.contextmanager
def without_noise_lines():
    """Run a library call whose printed lines include LIBRARY_LOG_NOISE's "stdout" ones: those are
    dropped, every other line is printed as it would have been (after the call)."""
    patterns = [re.compile(message) for logger, message, _ in LIBRARY_LOG_NOISE if logger == "stdout"]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True)
                if not any(p.match(line) for p in patterns)]
        sys.stdout.write("".join(kept))


def pytest_filters() -> list[str]:
    """The same list as pytest `filterwarnings` lines ("ignore:message:Category")."""
    return [f"ignore:{message}:{category.__name__}" for message, category, _ in LIBRARY_NOISE]
