"""Ids of many features packed into one value, for the input pipeline.

A training step that takes K SparseTensors pays at every call for
flattening 3 K tensors into the `tf.function` (~1.4 ms for 26 features
on 2 CPU cores) and for converting them to ragged form. `pack_ids` does
the conversion where the input pipeline runs (e.g. `tf.data`'s `map`,
ahead of the step), and its result crosses the call as 4-5 tensors, the
way FBGEMM and TorchRec models take one (ids, offsets) pair.
"""

from typing import List
from typing import Optional

import tensorflow as tf

from group_embedding.ops import ragged_ids

# Every feature starts on this many elements (64 bytes of int64), so
# that the lookup reads each feature's ids and row_splits in place.
_ALIGN = 8


class PackedIds(tf.experimental.ExtensionType):
    """K features' ids of one batch, made by `ge.pack_ids`.

    Attributes:
        values: int64 `[N]`; feature f's ids, grouped by row, start at
            `offsets[f]` (a multiple of 8; the gaps are padding).
        row_splits: int64 `[K, W]`, `W >= B + 1`; row f's first B + 1
            entries are feature f's row splits (starting at 0).
        offsets: int64 `[K]`.
        batch: int64 scalar B.
        weights: float32 `[N]` laid out as `values`, or `[0]` when no
            feature has weights.
    """

    values: tf.Tensor
    row_splits: tf.Tensor
    offsets: tf.Tensor
    batch: tf.Tensor
    weights: tf.Tensor

    class Spec:
        @classmethod
        def from_value(cls, value):
            # Only K is fixed: the id count and the batch change from batch
            # to batch, and a `tf.function` step must not retrace for them.
            # Whether there are weights stays static (`[0]`: none); a
            # weighted batch without ids pools to zeros either way.
            k = value.offsets.shape[0]
            weighted = value.weights.shape[0] != 0
            return cls(tf.TensorSpec([None], tf.int64),
                       tf.TensorSpec([k, None], tf.int64),
                       tf.TensorSpec([k], tf.int64),
                       tf.TensorSpec([], tf.int64),
                       tf.TensorSpec([None if weighted else 0], tf.float32))

    @property
    def weighted(self) -> bool:
        """Whether the features carry weights (known statically)."""
        return self.weights.shape.as_list() != [0]

    @property
    def num_features(self) -> Optional[int]:
        """K, when known statically."""
        return tf.compat.dimension_value(self.offsets.shape[0])


def _round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


def pack_ids(sp_ids: List, sp_weights: Optional[List] = None,
             name=None) -> PackedIds:
    """Packs K id features of one batch for `group_embedding_lookup_sparse`.

    `ge.group_embedding_lookup_sparse(params, ge.pack_ids(ids, weights),
    combiners)` equals the lookup on `ids` and `weights`, except that
    with `is_sequence=True` (as for RaggedTensor ids) an id's slot is its
    rank in its row (its column order for a SparseTensor) and each
    feature is padded to its longest row in the batch.

    Args:
        sp_ids: list of K `tf.SparseTensor [B, T]` or `tf.RaggedTensor
            [B, None]` integer ids (as `group_embedding_lookup_sparse`
            takes them), all with the same batch size B.
        sp_weights: None, or a list of K entries, each None or float
            weights shaped like its ids. Features without weights get
            weights of one, which pool to the same result.
        name: optional name scope.

    Returns:
        A `PackedIds`; pass it as `sp_ids` (and no `sp_weights`).

    Raises:
        TypeError, ValueError: as `group_embedding_lookup_sparse` for its
            `sp_ids` / `sp_weights` (kinds, dtypes, ranks, batch sizes).
    """
    if not isinstance(sp_ids, (list, tuple)) or not sp_ids:
        raise TypeError("`sp_ids` must be a non-empty list of id tensors, "
                        f"got {type(sp_ids).__name__}.")
    if sp_weights is None:
        sp_weights = [None] * len(sp_ids)
    if (not isinstance(sp_weights, (list, tuple))
            or len(sp_weights) != len(sp_ids)):
        raise ValueError(f"`sp_weights` must be None or a list of "
                         f"{len(sp_ids)} entries (None allowed per entry).")
    with tf.name_scope(name or "pack_ids"):
        # Row-major order, so that an id's rank in its row follows its
        # SparseTensor column (what `is_sequence=True` reads).
        sp_ids = [tf.sparse.reorder(x) if isinstance(x, tf.SparseTensor)
                  else x for x in sp_ids]
        sp_weights = [tf.sparse.reorder(w) if isinstance(w, tf.SparseTensor)
                      else w for w in sp_weights]
        feats = ragged_ids.to_feature_ids(list(sp_ids), list(sp_weights),
                                          same_batch=True)
        batch = ragged_ids.batch_size(feats[0])
        counts = [tf.size(f.values, out_type=tf.int64) for f in feats]
        padded = [_round_up(c, _ALIGN) for c in counts]
        offsets = tf.cumsum(tf.stack(padded), exclusive=True)

        def _laid_out(parts, dtype):
            pieces = []
            for part, c, p in zip(parts, counts, padded):
                pieces += [part, tf.zeros([p - c], dtype)]
            return tf.concat(pieces, 0)

        width = _round_up(batch + 1, _ALIGN)
        splits = tf.pad(tf.stack([f.row_splits for f in feats]),
                        tf.stack([[0, 0], [0, width - batch - 1]]))
        weights = tf.zeros([0], tf.float32)
        if any(f.weights is not None for f in feats):
            weights = _laid_out(
                [tf.ones_like(f.values, tf.float32) if f.weights is None
                 else f.weights for f in feats], tf.float32)
        return PackedIds(_laid_out([f.values for f in feats], tf.int64),
                         splits, offsets, batch, weights)
