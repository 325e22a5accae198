import os
import sys

# tests import their helpers (distributed.py) by module name
sys.path.insert(0, os.path.dirname(__file__))

# Subprocesses (launcher.sh, mpiexec, deepspeed) find this interpreter's environment first, so
# `.venv/bin/python -m pytest` works without activating the venv.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
