"""Stock-style embedding reads that also accept an `EmbeddingVariable`.

DeepRec scripts read an EmbeddingVariable (EV) with the stock functions:
`tf.nn.embedding_lookup(ev, ids)`, `tf.nn.embedding_lookup_sparse`,
`tf.nn.safe_embedding_lookup_sparse` and `tf.gather(ev, ids)`. Stock TF
cannot convert an EV to a tensor, so this module provides the same four
functions (`ge.embedding_lookup`, ...): given an EV (or a one-element list
holding one, which is what DeepRec's partitioned EV becomes here, see
`ge.get_embedding_variable(partitioner=...)`) they run the grouped lookup
with that one table; given anything else they are the stock TF1 function,
unchanged. `import group_embedding.compat` routes the stock names through
them (`ev_aware`).

EV reads are training reads: keys seen for the first time are inserted and
counted, as in DeepRec. Gradients reach the EV as `tf.IndexedSlices` keyed
by key, which `ge.train.*` (TF1 graphs) and `ge.optimizers.*` (eager)
apply.
"""

import functools
import inspect
from typing import Any
from typing import Callable
from typing import Optional

import tensorflow as tf
from tensorflow.python.ops import array_ops
from tensorflow.python.ops import embedding_ops

from group_embedding import lookup
from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.ops import ragged_ids


def as_embedding_variable(params, argument: str = "params"
                          ) -> Optional[EmbeddingVariable]:
    """The `EmbeddingVariable` that `params` names, or None.

    Args:
        params: an EV, a list/tuple holding exactly one EV, or anything else.
        argument: how the caller names `params` in messages.

    Returns:
        The EV, or None when `params` holds no EV (stock input).

    Raises:
        ValueError: a list of several EVs (one EV is one hash table here;
            there are no EV partitions to combine).
        TypeError: a list mixing EVs with other tables.
    """
    if is_embedding_variable(params):
        return params
    if not isinstance(params, (list, tuple)):
        return None
    evs = [p for p in params if is_embedding_variable(p)]
    if not evs:
        return None
    if len(evs) != len(params):
        raise TypeError(f"`{argument}` mixes EmbeddingVariables with other "
                        "tables; pass one EmbeddingVariable.")
    if len(evs) > 1:
        raise ValueError(
            f"`{argument}` holds {len(evs)} EmbeddingVariables "
            f"({', '.join(e.name for e in evs)}); an EmbeddingVariable is "
            "one hash table here and is not partitioned, pass one.")
    return evs[0]


def _rows(ev: EmbeddingVariable, ids, max_norm, partition_strategy,
          argument: str):
    """Rows of `ev` for `ids` of shape S: returns `S + [D]`, ragged where
    `ids` is (as stock returns for ragged ids)."""
    if isinstance(ids, tf.RaggedTensor):
        return ids.with_flat_values(_rows(ev, ids.flat_values, max_norm,
                                          partition_strategy, argument))
    ids = tf.convert_to_tensor(ids)
    ev.check_keys(ids, argument)
    (flat,) = lookup.group_embedding_lookup_sparse(
        [ev], [ragged_ids.one_id_rows(ids)], "sum",
        partition_strategy=partition_strategy, max_norm=max_norm)
    out = tf.reshape(flat, tf.concat([tf.shape(ids), [ev.embedding_dim]], 0))
    out.set_shape(ids.shape.concatenate([ev.embedding_dim]))
    return out


def embedding_lookup(params: Any, ids: Any, partition_strategy: str = "mod",
                     name: Optional[str] = None,
                     validate_indices: Any = True,
                     max_norm: Any = None) -> Any:
    """`tf.compat.v1.nn.embedding_lookup` that also reads an EV.

    Args:
        params: an `EmbeddingVariable` (or a one-element list of one), or
            whatever stock accepts (tensor, variable, list of shards,
            `PartitionedVariable`).
        ids: integer tensor of any shape S, or a `tf.RaggedTensor`. For an
            EV: keys (any value of its key dtype); new keys are inserted.
        partition_strategy: "mod" (default) or "div"; for an EV only
            validated.
        name: optional name scope.
        validate_indices: unused, as in stock.
        max_norm: if set, rows whose L2 norm exceeds it are rescaled to it.

    Returns:
        `S + [D]` tensor (a `tf.RaggedTensor` for ragged `ids`).

    Raises:
        TypeError: non-integer keys, or int64 keys for an int32 EV.
        ValueError / TypeError: see `as_embedding_variable`.
    """
    ev = as_embedding_variable(params)
    if ev is None:
        return embedding_ops.embedding_lookup(
            params, ids, partition_strategy=partition_strategy, name=name,
            validate_indices=validate_indices, max_norm=max_norm)
    del validate_indices  # unused by stock too
    with tf.name_scope(name or "embedding_lookup"):
        return _rows(ev, ids, max_norm, partition_strategy, "ids")


def gather(params: Any, indices: Any, validate_indices: Any = None,
           axis: Any = None, batch_dims: Any = 0,
           name: Optional[str] = None) -> Any:
    """`tf.gather` that also reads an EV (rows of `indices`' keys).

    Args:
        params: an `EmbeddingVariable`, or whatever stock `tf.gather`
            accepts.
        indices: integer tensor of any shape S, or a `tf.RaggedTensor`
            (keys, for an EV).
        validate_indices: deprecated and unused, as in stock.
        axis: for an EV, None or 0 (its rows).
        batch_dims: for an EV, 0.
        name: optional name scope.

    Returns:
        `S + [D]` for an EV (ragged for ragged `indices`); the stock result
        otherwise.

    Raises:
        ValueError: an EV with `axis` other than 0 or `batch_dims` != 0.
    """
    if not is_embedding_variable(params):
        return array_ops.gather_v2(params, indices, validate_indices, axis,
                                   batch_dims, name)
    if axis not in (None, 0) or batch_dims != 0:
        raise ValueError(
            f"gather from EmbeddingVariable '{params.name}': only axis=0 "
            f"and batch_dims=0 are supported (got axis={axis!r}, "
            f"batch_dims={batch_dims!r}); an EV is indexed by key only.")
    with tf.name_scope(name or "gather"):
        return _rows(params, indices, None, "mod", "indices")


def embedding_lookup_sparse(params: Any, sp_ids: Any, sp_weights: Any,
                            partition_strategy: str = "mod",
                            name: Optional[str] = None,
                            combiner: Optional[str] = None,
                            max_norm: Any = None,
                            allow_fast_lookup: bool = False) -> Any:
    """`tf.compat.v1.nn.embedding_lookup_sparse` that also reads an EV.

    For an EV the result equals stock on a `tf.Variable` holding the EV's
    rows at the row numbers of their keys, forward and backward: `[N, D]`
    with N = 1 + the largest row index present in `sp_ids` (stock drops
    trailing empty rows; empty rows before it are zeros).

    Args:
        params: an `EmbeddingVariable` (or a one-element list of one), or
            whatever stock accepts.
        sp_ids: `[B, T]` `tf.SparseTensor` of ids (keys for an EV), or for
            an EV also a `tf.RaggedTensor [B, None]` (then N = B).
        sp_weights: None, or float weights of the same kind and layout.
        partition_strategy: "mod" (default) or "div"; for an EV only
            validated.
        name: optional name scope.
        combiner: "sum", "mean" (default when None) or "sqrtn".
        max_norm: if set, rows are clipped to this L2 norm before pooling.
        allow_fast_lookup: stock speed switch; no effect for an EV.

    Returns:
        `[N, D]` tensor.

    Raises:
        TypeError: `sp_ids` is neither Sparse nor Ragged, or keys are not
            integers.
        ValueError: unknown combiner.
    """
    ev = as_embedding_variable(params)
    if ev is None:
        return embedding_ops.embedding_lookup_sparse(
            params, sp_ids, sp_weights, partition_strategy=partition_strategy,
            name=name, combiner=combiner, max_norm=max_norm,
            allow_fast_lookup=allow_fast_lookup)
    del allow_fast_lookup  # a speed switch of the stock path
    combiner = "mean" if combiner is None else combiner
    if not isinstance(sp_ids, (tf.SparseTensor, tf.RaggedTensor)):
        raise TypeError(f"embedding_lookup_sparse on EmbeddingVariable "
                        f"'{ev.name}': `sp_ids` must be a SparseTensor or "
                        f"RaggedTensor, got {type(sp_ids).__name__}.")
    with tf.name_scope(name or "embedding_lookup_sparse"):
        (out,) = lookup.group_embedding_lookup_sparse(
            [ev], [sp_ids], [combiner], [sp_weights],
            partition_strategy=partition_strategy, max_norm=max_norm)
        if isinstance(sp_ids, tf.SparseTensor):
            # Stock segments by row index: rows after the last one present
            # are not in its output.
            n = tf.cond(tf.size(sp_ids.values) > 0,
                        lambda: tf.reduce_max(sp_ids.indices[:, 0]) + 1,
                        lambda: tf.constant(0, tf.int64))
            out = out[:n]
        return out


def safe_embedding_lookup_sparse(embedding_weights: Any, sparse_ids: Any,
                                 sparse_weights: Any = None,
                                 combiner: str = "mean",
                                 default_id: Optional[int] = None,
                                 name: Optional[str] = None,
                                 partition_strategy: str = "div",
                                 max_norm: Any = None,
                                 allow_fast_lookup: bool = False) -> Any:
    """`tf.compat.v1.nn.safe_embedding_lookup_sparse` that also reads an EV.

    For an EV, as stock: ids < 0 are dropped (and, unless `combiner` is
    "sum", ids with weight <= 0); ids of rank R > 2 are pooled along their
    last dimension; an empty row gives zeros, or the row of `default_id`.

    Note: stock (and DeepRec) fill empty rows with id 0 and then zero them;
    on an EV that would insert key 0, so empty rows are left empty instead
    (same output, no spurious key).

    Args:
        embedding_weights: an `EmbeddingVariable` (or a one-element list of
            one), or whatever stock accepts.
        sparse_ids: `tf.SparseTensor [d_0, ..., d_n]` of ids, or a rank-2
            `tf.RaggedTensor [d_0, None]` (as stock TF 2.21 accepts).
        sparse_weights: None or weights like `sparse_ids` (sparse or
            ragged).
        combiner: "mean" (default), "sum" or "sqrtn".
        default_id: id (key) read by empty rows; None gives zeros.
        name: optional name scope.
        partition_strategy: "div" (default) or "mod"; for an EV only
            validated.
        max_norm: if set, rows are clipped to this L2 norm before pooling.
        allow_fast_lookup: stock speed switch; no effect for an EV.

    Returns:
        `[d_0, ..., d_{n-1}, D]` tensor.

    Raises:
        TypeError: `sparse_ids` is neither a SparseTensor nor a
            RaggedTensor.
        ValueError: unknown combiner.
    """
    ev = as_embedding_variable(embedding_weights, "embedding_weights")
    if ev is None:
        return embedding_ops.safe_embedding_lookup_sparse(
            embedding_weights, sparse_ids, sparse_weights=sparse_weights,
            combiner=combiner, default_id=default_id, name=name,
            partition_strategy=partition_strategy, max_norm=max_norm,
            allow_fast_lookup=allow_fast_lookup)
    del allow_fast_lookup
    if isinstance(sparse_ids, tf.RaggedTensor):
        # Stock prunes, fills and pools ragged ids exactly as their sparse
        # form: the same [d_0, D] result.
        sparse_ids = sparse_ids.to_sparse()
        if isinstance(sparse_weights, tf.RaggedTensor):
            sparse_weights = sparse_weights.to_sparse()
    if not isinstance(sparse_ids, tf.SparseTensor):
        raise TypeError(f"safe_embedding_lookup_sparse on EmbeddingVariable "
                        f"'{ev.name}': `sparse_ids` must be a SparseTensor "
                        f"or RaggedTensor, got {type(sparse_ids).__name__}.")
    with tf.name_scope(name or "safe_embedding_lookup_sparse"):
        shape = tf.cast(sparse_ids.dense_shape, tf.int64)
        flat_shape = tf.stack([tf.reduce_prod(shape[:-1]), shape[-1]])
        ids = tf.sparse.reshape(sparse_ids, flat_shape)
        weights = None
        if sparse_weights is not None:
            weights = tf.SparseTensor(ids.indices, sparse_weights.values,
                                      ids.dense_shape)
        keep = ids.values >= 0
        if weights is not None and combiner != "sum":
            keep = tf.logical_and(keep, weights.values > 0)
        ids = tf.sparse.retain(ids, keep)
        if weights is not None:
            weights = tf.sparse.retain(weights, keep)
        if default_id is not None:
            ids, _ = tf.sparse.fill_empty_rows(
                ids, tf.cast(default_id, ids.dtype))
            if weights is not None:
                weights, _ = tf.sparse.fill_empty_rows(
                    weights, tf.cast(1.0, weights.dtype))
        (out,) = lookup.group_embedding_lookup_sparse(
            [ev], [ids], [combiner], [weights],
            partition_strategy=partition_strategy, max_norm=max_norm)
        out = tf.reshape(out, tf.concat(
            [tf.cast(shape[:-1], tf.int32), [ev.embedding_dim]], 0))
        rank = sparse_ids.dense_shape.shape[0]
        if rank is not None:
            out.set_shape([None] * (rank - 1) + [ev.embedding_dim])
        return out


def _reads_ev(value) -> bool:
    # A one-element list of an EV is DeepRec's partitioned EV here.
    return is_embedding_variable(value) or (
        isinstance(value, (list, tuple)) and any(
            is_embedding_variable(v) for v in value))


def ev_aware(stock: Callable, ours: Callable, first: str) -> Callable:
    """`stock` unchanged unless its `first` argument holds an EV; then
    `ours` with the same arguments, bound by name (so TF1 and TF2
    signatures, whose argument orders differ, both work).

    This is how `group_embedding.compat` routes `tf.nn.embedding_lookup`
    (and the other stock reads) through this module's functions.

    Args:
        stock: the stock TF function.
        ours: this module's function of the same name.
        first: the name of `stock`'s argument that may hold an EV.

    Returns:
        A function with `stock`'s signature and metadata; the stock one is
        kept as its `__wrapped_stock__`.
    """
    signature = inspect.signature(stock)
    accepted = set(inspect.signature(ours).parameters)

    @functools.wraps(stock)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return stock(*args, **kwargs)  # stock's own error
        if not _reads_ev(bound.arguments.get(first)):
            return stock(*args, **kwargs)
        return ours(**{k: v for k, v in bound.arguments.items()
                       if k in accepted})

    wrapper.__wrapped_stock__ = stock  # type: ignore[attr-defined]
    return wrapper
