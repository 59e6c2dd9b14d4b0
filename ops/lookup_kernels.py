"""The custom-kernel backend of the grouped lookup: one op per group.

Plain float32 variables: `GroupEmbeddingPooledLookup` pools all tables
of the group straight into `[B, D]` outputs (no `[nnz, D]` intermediate),
`GroupEmbeddingConcatLookup` into one `[B, K * D]` output, and
`GroupEmbeddingSequenceLookup` writes each row into its `[B, T, D]` slot;
`max_norm` (a number >= 0) clips each row as it is read. The ops have CPU
kernels (ops/kernels/) and, when the CUDA library is loaded, GPU kernels
(ops/cuda/); TF runs the one where the tables live.

EmbeddingVariables: `GroupEmbeddingEVLookup` resolves keys (inserting new ones
in training, counting them, honouring the CounterFilter) and pools into `[B, D]`
in one op, `GroupEmbeddingEVSequenceLookup` writes unweighted sequences into
`[B, T, D]`.

Which groups come here is `lookup_plan`'s decision; the gradients of
these ops are in `lookup_gradients`.
"""

import math
import numbers
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from group_embedding.ops import kernel_library
from group_embedding.ops import lookup_gradients
from group_embedding.ops.ragged_ids import FeatureIds

lookup_gradients.register()


def kernel_max_norm(max_norm) -> Optional[float]:
    """`max_norm` as the kernels' attr (-1: off), or None when only the TF
    path can apply it (a tensor, or a negative bound, which stock applies
    as a sign flip)."""
    if max_norm is None:
        return -1.0
    # numbers.Real also admits numpy scalars.
    if (isinstance(max_norm, numbers.Real)
            and not isinstance(max_norm, (bool, np.bool_))
            and float(max_norm) >= 0 and math.isfinite(max_norm)):
        return float(max_norm)
    return None


def _watch(tables):
    # The kernels read the tables through their handles: tell the tapes
    # and the function being traced, as a variable read does. (Telling
    # the tapes only, a function traced without a tape gave no gradient
    # when called under one later.)
    for t in tables:
        resource_variable_ops.variable_accessed(t)


def _kernel_weights(feats: Sequence[FeatureIds]) -> List[tf.Tensor]:
    """Per-feature weights for the kernels; an empty tensor means none."""
    empty = tf.zeros([0], tf.float32)
    return [empty if f.weights is None else f.weights for f in feats]


def _variable_pooling(op, tables, feats, combiners, table_names, max_norm,
                      ids_checked):
    """Calls a pooled lookup op of plain variables (per-table or
    concatenated outputs); they take the same inputs and attrs."""
    _watch(tables)
    return op(tables=[t.handle for t in tables],
              ids=[f.values for f in feats],
              row_splits=[f.row_splits for f in feats],
              weights=_kernel_weights(feats),
              combiners=list(combiners), table_names=list(table_names),
              embedding_dim=int(tables[0].shape[1]),
              max_norm=kernel_max_norm(max_norm), ids_checked=ids_checked)


def pooled_variables(tables, feats, combiners, table_names,
                     max_norm=None, ids_checked=False) -> List[tf.Tensor]:
    """`GroupEmbeddingPooledLookup`: one `[B, D]` output per table.

    Args:
        tables: `[vocab_i, D]` float32 variables.
        feats: one `FeatureIds` per table, all with the same batch size B.
        combiners: "sum" | "mean" | "sqrtn" per table.
        table_names: names used in error messages.
        max_norm: None, or a number >= 0 rows are clipped to.
        ids_checked: a `check_ids` op of the same step, which the op runs
            after, checked these ids (the GPU kernel then does not wait
            to read its own error counts).
    """
    return _variable_pooling(
        kernel_library.library().group_embedding_pooled_lookup, tables,
        feats, combiners, table_names, max_norm, ids_checked)


def concat_variables(tables, feats, combiners, table_names,
                     max_norm=None, ids_checked=False) -> tf.Tensor:
    """`GroupEmbeddingConcatLookup`: ONE `[B, K * D]` output, each table's
    pooled rows written straight into its columns; its gradient reads them
    from the concatenated gradient (no concat copy, no split). Arguments as
    in `pooled_variables`."""
    return _variable_pooling(
        kernel_library.library().group_embedding_concat_lookup, tables,
        feats, combiners, table_names, max_norm, ids_checked)


def check_ids(tables, feats, table_names) -> Any:
    """`GroupEmbeddingCheckIds`: ONE check of the ids of several groups
    (issue 35.3), for lookups on the GPU kernels built after it with
    `ids_checked=True`: a step of several groups then waits for its
    stream once. Raises at run time what the lookups would (the table and
    the id). Returns the op, for control dependencies.

    Args:
        tables: the plain variables of every group, in any order.
        feats: their `FeatureIds` (sequence features with positions).
        table_names: their names for error messages.
    """
    empty = tf.zeros([0], tf.int64)
    none = tf.constant(0, tf.int64)
    return kernel_library.library().group_embedding_check_ids(
        tables=[t.handle for t in tables],
        ids=[f.values for f in feats],
        row_splits=[f.row_splits for f in feats],
        positions=[empty if f.positions is None else f.positions
                   for f in feats],
        max_lens=[none if f.max_len is None
                  else tf.cast(f.max_len, tf.int64) for f in feats],
        table_names=list(table_names))


def _sequence_layout(feats: Sequence[FeatureIds]) -> dict:
    """Where each id goes in the `[B, T, D]` outputs, as both sequence
    kernels take it: row splits, slots in the rows, padded lengths T."""
    return dict(row_splits=[f.row_splits for f in feats],
                positions=[f.positions for f in feats],
                max_lens=[tf.cast(f.max_len, tf.int64) for f in feats])


def sequence_variables(tables, feats, table_names,
                       max_norm=None, ids_checked=False) -> List[tf.Tensor]:
    """`GroupEmbeddingSequenceLookup`: each id's (clipped, weighted) row
    written straight into its `[B, T, D]` slot; its gradient sums per
    unique id, so no `[nnz, D]` tensor exists either way."""
    _watch(tables)
    return kernel_library.library().group_embedding_sequence_lookup(
        tables=[t.handle for t in tables],
        ids=[f.values for f in feats],
        **_sequence_layout(feats),
        weights=_kernel_weights(feats),
        table_names=list(table_names),
        embedding_dim=int(tables[0].shape[1]),
        max_norm=kernel_max_norm(max_norm), ids_checked=ids_checked)


def pooled_ev(variables: Sequence[Any], feats: Sequence[FeatureIds],
              combiners: Sequence[str], training: Any) -> List[tf.Tensor]:
    """`GroupEmbeddingEVLookup`: pooled `[B_i, D]` lookups of same-dim EVs.

    Row b of output i pools (with `combiners[i]` and the weights of `feats[i]`)
    the rows `GroupEmbeddingEVGather` would return for the keys of row b, so
    both EV paths agree exactly; one variable may appear several times (shared
    columns). Its gradient gives each variable its unique keys with their summed
    gradients (see `lookup_gradients`).
    """
    _watch(variables)
    return kernel_library.library().group_embedding_ev_lookup(
        handles=[v.handle for v in variables],
        keys=[f.values for f in feats],
        row_splits=[f.row_splits for f in feats],
        weights=_kernel_weights(feats),
        default_values=[v.default_values for v in variables],
        training=tf.convert_to_tensor(training, tf.bool),
        combiners=list(combiners),
        embedding_dim=int(variables[0].embedding_dim))


def sequence_ev(variables: Sequence[Any], feats: Sequence[FeatureIds],
                training: Any) -> List[tf.Tensor]:
    """`GroupEmbeddingEVSequenceLookup`: each key's row (as
    `GroupEmbeddingEVGather` reads it) written straight into its `[B, T, D]`
    slot; its gradient gives each variable its unique keys and their summed
    gradients. Unweighted."""
    _watch(variables)
    return kernel_library.library().group_embedding_ev_sequence_lookup(
        handles=[v.handle for v in variables],
        keys=[f.values for f in feats],
        **_sequence_layout(feats),
        default_values=[v.default_values for v in variables],
        training=tf.convert_to_tensor(training, tf.bool),
        embedding_dim=int(variables[0].embedding_dim))
