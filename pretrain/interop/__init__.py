"""Checkpoint interop: whole-tensor views of native checkpoints (native.py), Hugging Face
directories (hf.py), and loading either into a running engine of any layout (apply.py)."""
