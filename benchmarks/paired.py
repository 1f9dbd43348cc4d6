"""Paired comparisons over seeds, as the benchmarks' targets read them (federated.py, dedup.py).

Two runs on one seed share the partition, the initial model and the batches,
so their difference is the method's effect plus far less noise than two
unrelated runs'. A target on such differences asks whether their mean clears
a margin with 95% confidence: the one-sided lower bound of Student's t
interval, which needs two or more seeds and widens as they scatter.
"""
from __future__ import annotations

import numpy as np
from scipy import stats  # scikit-learn's dependency


def lower_bound(differences, confidence: float = 0.95) -> float:
    """The one-sided lower confidence bound of the mean of paired differences; -inf for fewer than two."""
    d = np.asarray(differences, dtype=float)
    if len(d) < 2:
        return float("-inf")
    return float(d.mean() - stats.t.ppf(confidence, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
