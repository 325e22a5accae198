"""Data: `preprocess` turns text into indexed token files (tools/preprocess_data.py); `samples`
turns those files into the training samples and micro-batches the loop draws."""
