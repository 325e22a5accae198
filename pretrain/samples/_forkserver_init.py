"""Imported by the forkserver that starts the loader processes (batches.FORKSERVER_PRELOAD), and by
nothing else: importing it makes this process ignore SIGTERM and SIGINT.

A SIGTERM or Ctrl-C sent to the whole job reaches every process of it. The rank answers it by
saving and stopping (pretrain/trainer.py), which takes some steps; a forkserver killed meanwhile
takes its loader processes with it (they end when their parent does) and the rank fails mid-way.
The forkserver ends by itself when its rank does, and its loader processes inherit this setting.
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
