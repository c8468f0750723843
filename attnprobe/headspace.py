"""The space of heads that `related` measures: what the [head, head] Jensen-Shannon divergence matrix says about
which heads attend alike (the nearest heads of one, a clustering tree, 2-D coordinates). Pure numpy (scipy for the
tree), no model: the figures (plotting.related) and the report read it; similarity.py runs the model to fill it."""

from __future__ import annotations

import math

import numpy as np

from attnprobe.errors import AttnprobeError

LN2 = math.log(2.0)  # the largest JS divergence of two distributions, in nats
NEAREST = 5  # the report lists this many nearest heads of the selected one


def nearest_heads(js: np.ndarray, layers: np.ndarray, heads: np.ndarray, layer: int, head: int,
                  count: int = NEAREST) -> list[tuple[int, int, float]]:
    """(layer, head, JS) of the `count` heads of smallest JS to (layer, head), itself left out; ties by index."""
    match = np.flatnonzero((layers == layer) & (heads == head))
    if not len(match):
        raise AttnprobeError(f"no head L{layer}H{head} in this similarity matrix")
    i = int(match[0])
    order = [j for j in np.argsort(js[i], kind="stable") if j != i][:count]
    return [(int(layers[j]), int(heads[j]), float(js[i, j])) for j in order]


def cluster(js: np.ndarray) -> np.ndarray:
    """Average-linkage hierarchical clustering of the heads on the JS distance sqrt(JS), leaves in optimal order
    (neighbours in the order are as alike as the tree allows): a scipy linkage matrix [head - 1, 4]."""
    from scipy.cluster.hierarchy import linkage, optimal_leaf_ordering
    from scipy.spatial.distance import squareform

    distances = squareform(np.sqrt(np.clip(np.asarray(js, dtype=np.float64), 0.0, None)), checks=False)
    return optimal_leaf_ordering(linkage(distances, method="average"), distances)


def classical_mds(js: np.ndarray, dims: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Classical (Torgerson) multidimensional scaling of the JS distance sqrt(JS), a metric: [head, head] ->
    (coordinates [head, dims], share of the variance each axis shows [dims]).

    B = -1/2 C JS C with C the centring matrix (JS is the squared distance); the coordinates are B's top
    eigenvectors scaled by the square roots of their eigenvalues. Distances in the plane approximate
    sqrt(JS); the shares say how much of the spread they keep (the rest lies in other directions).
    """
    js = np.asarray(js, dtype=np.float64)
    n = js.shape[0]
    centring = np.eye(n) - np.full((n, n), 1.0 / n)  # [head, head]
    inner = -0.5 * centring @ js @ centring  # [head, head]
    values, vectors = np.linalg.eigh((inner + inner.T) / 2)  # ascending
    order = np.argsort(values)[::-1][:dims]
    kept = np.clip(values[order], 0.0, None)  # [dims]
    coords = vectors[:, order] * np.sqrt(kept)  # [head, dims]
    positive = values[values > 0].sum()
    shares = kept / positive if positive > 0 else np.zeros_like(kept)
    if coords.shape[1] < dims:  # fewer heads than axes
        coords = np.pad(coords, ((0, 0), (0, dims - coords.shape[1])))
        shares = np.pad(shares, (0, dims - len(shares)))
    return coords, shares
