"""The fixed file names of a checkpoint directory (import-free: read before torch is loaded, by the
pre-start checks of vocabulary.py as by format.py)."""

LATEST = "latest"
META = "meta.json"
CONFIG_JSON = "config.json"  # what makes a directory a Hugging Face model (hf.py)
VOCAB_FILE = "vocab.txt"
TOKENIZER_JSON = "tokenizer.json"
