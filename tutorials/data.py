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
    return frame, roc_auc(label, prob)


def roc_auc(label, score):
    """Exact ROC AUC of `score` against 0/1 `label` (rank statistic)."""
    order = np.argsort(score)
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    pos = label.sum()
    neg = len(label) - pos
    return float((ranks[label == 1].sum() - pos * (pos + 1) / 2)
                 / max(pos * neg, 1))


def write_csv(frame, path):
    """Writes a frame from `generate` as CSV (missing values as empty)."""
    frame.to_csv(path, index=False)


def read_csv(path):
    """Reads a CSV written by `write_csv` back into a frame.

    Categorical columns are read as strings, so integer ids keep their
    text ("17", not 17.0) and a missing value stays "" rather than NaN;
    dense columns are floats with NaN for missing.
    """
    frame = pd.read_csv(path, dtype={c: str for c in SPARSE_COLUMNS},
                        keep_default_na=False)
    for col in DENSE_COLUMNS:
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame


def raw_columns(frame):
    """The raw feature dict of a frame: what a server receives.

    Returns `{I*: float32 [N] (NaN = missing), C*: string [N] ("|"-joined
    tokens, "" = missing)}` as numpy arrays.
    """
    raw = {c: frame[c].to_numpy(np.float32) for c in DENSE_COLUMNS}
    for col in SPARSE_COLUMNS:
        raw[col] = frame[col].fillna("").astype(str).to_numpy()
    return raw


def raw_signature():
    """`tf.TensorSpec`s of a batch of `raw_columns` (for tf.function)."""
    spec = {c: tf.TensorSpec([None], tf.float32, c) for c in DENSE_COLUMNS}
    spec.update({c: tf.TensorSpec([None], tf.string, c)
                 for c in SPARSE_COLUMNS})
    return spec


def parse_raw(raw):
    """Turns a batch of raw columns into model features.

    Used by `to_dataset` and by the exported serving function, so training
    and serving run the very same ops.

    Args:
        raw: dict of `[B]` tensors as in `raw_columns`.

    Returns:
        `features["dense"]`: `[B, 13]` float32, log1p of the counts with
        missing -> 0; `features[C*]`: `[B, None]` string RaggedTensors of
        tokens (an empty row is a missing value).
    """
    dense = tf.stack([raw[c] for c in DENSE_COLUMNS], axis=1)
    dense = tf.math.log1p(tf.where(tf.math.is_nan(dense),
                                   tf.zeros_like(dense), dense))
    out = {"dense": dense}
    for col in SPARSE_COLUMNS:
        # "" splits to [""], which is dropped: a missing value.
        tokens = tf.strings.split(raw[col], sep="|")
        # tf.not_equal, not `!=`: in a TF1 graph `!=` on a RaggedTensor
        # compares Python objects.
        out[col] = tf.ragged.boolean_mask(tokens, tf.not_equal(tokens, ""))
    return out


def to_dataset(source, batch_size, shuffle=False, seed=0):
    """Turns a frame from `generate` (or a CSV path) into a batched
    tf.data pipeline.

    Args:
        source: a DataFrame from `generate`, or the path of a CSV written
            by `write_csv` (read with `read_csv`).
        batch_size: examples per batch (the last batch may be smaller).
        shuffle: shuffle examples (buffer of up to 50k) before batching.
        seed: shuffle seed.

    Returns:
        A dataset of `(features, label)`, features as in `parse_raw` and
        label a `[B]` float32.
    """
    frame = read_csv(source) if isinstance(source, str) else source
    label = frame["label"].to_numpy(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((raw_columns(frame), label))
    if shuffle:
        ds = ds.shuffle(min(len(frame), 50_000), seed=seed)
    return ds.batch(batch_size).map(
        lambda raw, y: (parse_raw(raw), y),
        num_parallel_calls=tf.data.AUTOTUNE)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--vocab-cap", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/criteo_like.csv")
    args = parser.parse_args()
    frame, auc = generate(args.rows, args.vocab_cap, args.seed)
    write_csv(frame, args.out)
    print(f"wrote {len(frame)} rows to {args.out}; "
          f"click rate {frame.label.mean():.3f}, bayes AUC {auc:.3f}")


if __name__ == "__main__":
    main()
