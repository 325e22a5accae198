"""A job that never hangs without a word: the hang watchdog with its stack dumps (watchdog.py),
the status a failed or stopped rank leaves for the launcher (launch_status.py), and torchrun as
the launcher runs it, its failure report in one line per rank (torchrun.py)."""
