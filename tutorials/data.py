"""Generates a Criteo-like click log with a hidden logistic ground truth.

13 dense columns I1..I13 (skewed counts, some missing) and 26 categorical
columns C1..C26: C1-C13 one-hot, C14-C26 multi-hot ("|"-separated), ids
Zipf-distributed, half of the columns as 8-hex-digit strings (like the real
log) and half as integers, some values missing. The label is drawn from
sigmoid(sum of hidden per-id weights + linear dense term), so a model can
genuinely learn it; `bayes_auc` is the AUC of the true probabilities.

    python tutorials/data.py --rows 100000 --out /tmp/criteo_like.csv
"""

import argparse

import numpy as np
import pandas as pd
import tensorflow as tf

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_COLUMNS = [f"I{i + 1}" for i in range(NUM_DENSE)]
SPARSE_COLUMNS = [f"C{i + 1}" for i in range(NUM_SPARSE)]
MULTI_HOT_COLUMNS = SPARSE_COLUMNS[13:]
STRING_COLUMNS = SPARSE_COLUMNS[::2]
# Criteo Kaggle cardinalities (SPEC section 6); capped by `vocab_cap`.
CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3,
                 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652,
                 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def _zipf_ids(rng, vocab, size, alpha=1.05):
    # Inverse-CDF sampling of a truncated Zipf law over ranks 0..vocab-1.
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -alpha)
    cdf /= cdf[-1]
    return np.searchsorted(cdf, rng.random(size)).astype(np.int64)


def generate(rows=100_000, vocab_cap=20_000, seed=0, missing_rate=0.05):
    """Returns (DataFrame with `label`, I*, C* columns, bayes AUC).

    Args:
        rows: number of examples.
        vocab_cap: cap on each column's cardinality.
        seed: RNG seed; the same seed gives the same data and truth.
        missing_rate: fraction of missing values per column.
    """
    rng = np.random.default_rng(seed)
    data = {}
    logit = np.full(rows, -2.0)
    for j, col in enumerate(DENSE_COLUMNS):
        x = np.floor(rng.lognormal(1.0, 1.2, rows))
        logit += rng.normal(0, 0.15) * np.log1p(x)
        x[rng.random(rows) < missing_rate] = np.nan
        data[col] = x
    for j, col in enumerate(SPARSE_COLUMNS):
        vocab = min(CARDINALITIES[j], vocab_cap)
        truth = rng.normal(0, 0.6, vocab)
        lengths = (rng.integers(1, 4, rows) if col in MULTI_HOT_COLUMNS
                   else np.ones(rows, np.int64))
        lengths[rng.random(rows) < missing_rate] = 0
        ids = _zipf_ids(rng, vocab, int(lengths.sum()))
        # Scatter the hot ids so id value says nothing about frequency.
        ids = rng.permutation(vocab)[ids]
        row_of_id = np.repeat(np.arange(rows), lengths)
        row_truth = np.bincount(row_of_id, truth[ids], minlength=rows)
        logit += np.where(lengths > 0, row_truth / np.maximum(lengths, 1), 0)
        if col in STRING_COLUMNS:
            tokens = np.array([f"{(i * 2654435761) & 0xffffffff:08x}"
                               for i in range(vocab)])[ids]
        else:
            tokens = ids.astype(str)
        cells = np.split(tokens, np.cumsum(lengths)[:-1])
        data[col] = ["|".join(c) for c in cells]
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(rows) < prob).astype(np.int64)
    frame = pd.DataFrame({"label": label, **data})
    return frame, _auc(label, prob)


def _auc(label, score):
    order = np.argsort(score)
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    pos = label.sum()
    neg = len(label) - pos
    return float((ranks[label == 1].sum() - pos * (pos + 1) / 2)
                 / max(pos * neg, 1))


def to_dataset(frame, batch_size, shuffle=False, seed=0):
    """Turns a frame from `generate` into a batched tf.data pipeline.

    Yields `(features, label)`: `features["dense"]` is `[B, 13]` float
    (log1p of counts, missing -> 0) and `features[C*]` are `[B, None]`
    RaggedTensors of string tokens (empty row = missing).
    """
    dense = np.log1p(frame[DENSE_COLUMNS].fillna(0).to_numpy(np.float32))
    tensors = {"dense": dense}
    for col in SPARSE_COLUMNS:
        tensors[col] = frame[col].fillna("").astype(str).to_numpy()
    label = frame["label"].to_numpy(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((tensors, label))
    if shuffle:
        ds = ds.shuffle(min(len(frame), 50_000), seed=seed)

    def split_tokens(features, y):
        out = {"dense": features["dense"]}
        for col in SPARSE_COLUMNS:
            # "" splits to [""], which is dropped: a missing value.
            tokens = tf.strings.split(features[col], sep="|")
            # tf.not_equal, not `!=`: in a TF1 graph `!=` on a
            # RaggedTensor compares Python objects.
            out[col] = tf.ragged.boolean_mask(tokens,
                                              tf.not_equal(tokens, ""))
        return out, y

    return ds.batch(batch_size).map(split_tokens,
                                    num_parallel_calls=tf.data.AUTOTUNE)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--vocab-cap", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/criteo_like.csv")
    args = parser.parse_args()
    frame, auc = generate(args.rows, args.vocab_cap, args.seed)
    frame.to_csv(args.out, index=False)
    print(f"wrote {len(frame)} rows to {args.out}; "
          f"click rate {frame.label.mean():.3f}, bayes AUC {auc:.3f}")


if __name__ == "__main__":
    main()
