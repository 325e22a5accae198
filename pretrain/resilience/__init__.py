"""A job that never hangs without a word: the hang watchdog with its stack dumps (watchdog.py) and
the status a failed rank leaves for the launcher (launch_status.py)."""
