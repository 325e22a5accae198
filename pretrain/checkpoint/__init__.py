"""Everything about checkpoints, one module per job:

- format.py: names, paths and meta.json (the files of a layout, parameter names, `latest`);
- exact.py: the trainer's save and bit-exact resume in the same layout (DeepSpeed's files, RNG);
- logical.py: any layout read into whole tensors by Hugging Face name, written at any TP x PP;
- hf.py: Hugging Face directories <-> those whole tensors;
- load.py: whole tensors into a running engine of any layout (layout-free resume, init_from);
- sharding.py: whole tensor <-> this rank's TP shard; tokenizer_files.py: the tokenizer kept
  with the weights; vocabulary.py: the run's vocabulary against its checkpoint's, before start;
- filenames.py: the fixed file names (import-free).
"""
