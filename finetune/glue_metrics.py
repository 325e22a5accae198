"""GLUE metrics from scikit-learn and scipy, as the GLUE benchmark reports them."""
from __future__ import annotations

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def accuracy(labels, predictions) -> dict:
    return {"accuracy": float(accuracy_score(labels, predictions))}


def accuracy_and_f1(labels, predictions) -> dict:
    """MRPC, QQP: accuracy and F1 of the positive class (label 1)."""
    return {"accuracy": float(accuracy_score(labels, predictions)),
            "f1": float(f1_score(labels, predictions, pos_label=1, average="binary"))}


def matthews(labels, predictions) -> dict:
    """CoLA: Matthews correlation coefficient."""
    return {"matthews_corr": float(matthews_corrcoef(labels, predictions))}


def pearson_and_spearman(labels, predictions) -> dict:
    """STS-B: Pearson and Spearman correlation of the predicted similarity scores."""
    labels, predictions = np.asarray(labels, dtype=np.float64), np.asarray(predictions, dtype=np.float64)
    return {"pearson": float(pearsonr(predictions, labels)[0]), "spearman": float(spearmanr(predictions, labels)[0])}


METRICS = {"accuracy": accuracy, "accuracy_f1": accuracy_and_f1, "matthews": matthews,
           "pearson_spearman": pearson_and_spearman}
