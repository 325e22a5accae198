"""Contrastive training of embedding models (issue 53): pooling, the InfoNCE loss over the global
batch (loss.py), and, as they come, the data, the trainer, retrieval evaluation and export."""
