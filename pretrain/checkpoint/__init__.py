"""Everything about checkpoints, one module per job:

- format.py: names, paths and meta.json (the files of a layout, parameter names, `latest`);
- exact.py: the trainer's save and bit-exact resume in the same layout (DeepSpeed's files, RNG);
- logical.py: any layout read into whole tensors by Hugging Face name, written at any TP x PP;
- hf.py: Hugging Face directories <-> those whole tensors;
- load.py: whole tensors into a running engine of any layout (layout-free resume, init_from);
- sharding.py: whole tensor <-> this rank's TP shard; tokenizer_files.py: the tokenizer kept
  with the weights;
- the checks before any rank starts (torch-free): vocabulary.py (the run's vocabulary against its
  checkpoint's), data_sequence.py (a resume's data settings against the checkpoint's),
  starting_point.py (init_from's model shape taken or compared, the heads it lacks), with
  hf_config.py (a Hugging Face config.json, read without torch);
- filenames.py, errors.py: the fixed file names and CheckpointError (import-free).
"""
