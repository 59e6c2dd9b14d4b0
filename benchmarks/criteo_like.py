"""The "criteo-like" benchmark workload (SPEC.md section 6).

26 sparse features with the Criteo Kaggle cardinalities, each table capped
at `cap` rows; features 0-12 are one-hot, 13-25 multi-hot with a row length
uniform in [1, 10]. Ids follow a Zipf law (alpha 1.05) truncated to the
table, then go through a fixed random permutation of the table's ids, so
hot ids are scattered over the table instead of packed at its start.

`make_id_batches` needs only numpy (the GPU benchmark runs it on a machine
without TensorFlow); `make_batches` wraps its ids into SparseTensors.
"""

from __future__ import annotations

import numpy as np

CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
    8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
    286181, 105, 142572)
NUM_ONE_HOT = 13
MAX_MULTI_HOT = 10
ZIPF_ALPHA = 1.05


def vocab_sizes(cap: int) -> list[int]:
    """Rows of each of the 26 tables once capped at `cap`."""
    return [min(c, cap) for c in CARDINALITIES]


class _ZipfIds:
    """Samples ids of one table: truncated Zipf rank, then a permutation.

    Sampling inverts the exact CDF of p(rank k) ~ k^-alpha on [1, vocab]
    (no rejection loop, which would spin on tiny tables).
    """

    def __init__(self, vocab: int, rng: np.random.Generator):
        weights = np.arange(1, vocab + 1, dtype=np.float64) ** -ZIPF_ALPHA
        self._cdf = np.cumsum(weights) / weights.sum()
        self._perm = rng.permutation(vocab).astype(np.int64)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        rank = np.searchsorted(self._cdf, rng.random(n), side="right")
        # Round-off can leave cdf[-1] a hair below 1.
        rank = np.minimum(rank, len(self._perm) - 1)
        return self._perm[rank]


def _sparse_batch(ids: np.ndarray, lengths: np.ndarray, width: int):
    """SparseTensor [batch, width] with row-major (sorted) indices."""
    # Imported here: the numpy part of this module must load without TF.
    import tensorflow as tf
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    cols = np.arange(len(ids), dtype=np.int64) - np.repeat(starts, lengths)
    return tf.SparseTensor(np.stack([rows, cols], axis=1), ids,
                           [len(lengths), width])


def make_id_batches(cap: int, batch: int, num_batches: int,
                    seed: int = 0) -> list[list[tuple]]:
    """Pre-generates `num_batches` batches of the 26 id features (numpy).

    Returns:
        A list of batches; each is a list of 26 `(ids, lengths, width)`:
        int64 ids in row-major order, int64 `[batch]` row lengths (all 1
        for one-hot features) and the dense width (1 or 10).
    """
    rng = np.random.default_rng(seed)
    samplers = [_ZipfIds(v, rng) for v in vocab_sizes(cap)]
    batches = []
    for _ in range(num_batches):
        features = []
        for f, sampler in enumerate(samplers):
            if f < NUM_ONE_HOT:
                lengths = np.ones(batch, dtype=np.int64)
                width = 1
            else:
                lengths = rng.integers(1, MAX_MULTI_HOT + 1, size=batch)
                width = MAX_MULTI_HOT
            ids = sampler.sample(int(lengths.sum()), rng)
            features.append((ids, lengths, width))
        batches.append(features)
    return batches


def make_batches(cap: int, batch: int, num_batches: int,
                 seed: int = 0) -> list:
    """Pre-generates `num_batches` batches of the 26 id features.

    Returns:
        A list of batches; each is a list of 26 int64 `tf.SparseTensor`s,
        `[batch, 1]` for one-hot and `[batch, 10]` for multi-hot features.
    """
    return [[_sparse_batch(ids, lengths, width)
             for ids, lengths, width in features]
            for features in make_id_batches(cap, batch, num_batches, seed)]


def initial_tables(cap: int, dim: int, seed: int = 0) -> list[np.ndarray]:
    """Initial values of the 26 tables, uniform in [-0.05, 0.05).

    Every variant copies these, so all start from identical tables.
    """
    rng = np.random.default_rng(seed + 1)
    return [rng.uniform(-0.05, 0.05, size=(v, dim)).astype(np.float32)
            for v in vocab_sizes(cap)]
