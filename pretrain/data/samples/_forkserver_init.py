"""Imported by the forkserver that starts the loader processes (batches.FORKSERVER_PRELOAD), and by
nothing else: importing it makes this process ignore SIGTERM and SIGINT.

A SIGTERM or Ctrl-C sent to the whole job reaches every process of it. The rank answers it by
saving and stopping (pretrain/training/trainer.py), which takes some steps; a forkserver killed meanwhile
takes its loader processes with it (they end when their parent does) and the rank fails mid-way.
Its loader processes inherit this setting; the rank stops them itself (SIGKILL where a graceful
stop does not do, pretrain/data/samples/batches.py). And a rank that dies (SIGKILL, the OOM killer)
takes this forkserver with it (the kernel's parent-death signal), and the forkserver its loader
processes, so that nothing outlives the job holding memory or its log's pipe.

It also installs the programs' list of library noise first: the forkserver then imports the
dataset's module, and megatron-core warns on import once per process (4 lines per loader per rank).
"""
from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from pretrain.data.samples.batches import leave_signals_to_the_rank  # noqa: E402

leave_signals_to_the_rank()
