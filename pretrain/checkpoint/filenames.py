"""The fixed file names and tag pattern of a checkpoint directory (import-free: read before torch is
loaded, by the pre-start checks of vocabulary.py and series.py as by format.py)."""
import re

LATEST = "latest"
META = "meta.json"
CONFIG_JSON = "config.json"  # what makes a directory a Hugging Face model (hf.py)
VOCAB_FILE = "vocab.txt"
TOKENIZER_JSON = "tokenizer.json"
PARTIAL = ".partial"  # suffix of a tag directory being written
REPLACED = ".replaced"  # suffix of a complete checkpoint while a new save of its step replaces it
TAG_PATTERN = re.compile(r"iter_(\d+)")
