"""Validation and normalisation of the arguments of the grouped lookups.

Every id feature leaves this module in one ragged form, `FeatureIds`
(int64 values grouped by row + row_splits, optional float weights), which is
what the fused kernels consume. Errors name the argument and its index.
"""

import dataclasses
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import tensorflow as tf

from group_embedding import lookup_plan
from group_embedding.ops import ragged_ids
from group_embedding.ops import tf_variables
from group_embedding.ops.ragged_ids import FeatureIds

SUPPORTED_COMBINERS = ("sum", "mean", "sqrtn")
PARTITION_STRATEGIES = ("mod", "div")


def unwrap_table(param: Any, index: int) -> Any:
    """Returns the `tf.Variable` behind `param` (Keras 3 variables wrap one).

    Raises:
        TypeError: if `param` is not a variable.
    """
    param = tf_variables.to_tf_variable(param)
    if lookup_plan.table_kind(param) != lookup_plan.VARIABLE:
        return param  # EmbeddingVariable, ShardedVariable
    if not isinstance(param, tf.Variable):
        raise TypeError(
            f"`params[{index}]` must be a tf.Variable, keras.Variable or "
            f"EmbeddingVariable, got {type(param).__name__}.")
    if param.shape.rank != 2:
        raise ValueError(
            f"`params[{index}]` ({param.name}) must be a [vocab, dim] table, "
            f"got shape {param.shape}.")
    return param


def table_name(param: Any, index: int) -> str:
    """Names a table in error messages: `params[i] (variable name)`."""
    name = getattr(param, "name", None)
    return f"params[{index}] ({name})" if name else f"params[{index}]"


def check_lists(params: Any, sp_ids: Any, combiners: Any, sp_weights: Any,
                partition_strategy: str, params_num_per_group: int,
                ids_argument: str = "sp_ids"
                ) -> Tuple[List[Any], List[Any], List[Any], List[Any]]:
    """Checks the list arguments' lengths and the closed choices.

    Returns:
        (params, sp_ids, combiners, sp_weights) as lists of one length.

    Raises:
        TypeError: a list argument is not a list.
        ValueError: lengths differ, unknown combiner or partition strategy,
            or a non-positive `params_num_per_group`.
    """
    if not isinstance(params, (list, tuple)):
        raise TypeError("`params` must be a list of tables, got "
                        f"{type(params).__name__}.")
    if not isinstance(sp_ids, (list, tuple)):
        raise TypeError(f"`{ids_argument}` must be a list (one entry per "
                        f"table), got {type(sp_ids).__name__}.")
    n = len(params)
    if n == 0:
        raise ValueError("`params` is empty: give at least one table.")
    if len(sp_ids) != n:
        raise ValueError(f"`{ids_argument}` has {len(sp_ids)} entries but "
                         f"`params` has {n}; give one id tensor per table.")
    if isinstance(combiners, str):
        combiners = [combiners] * n
    if combiners is None or len(combiners) != n:
        got = None if combiners is None else len(combiners)
        raise ValueError(f"`combiners` has {got} entries but `params` has "
                         f"{n}; give one combiner per table or one string.")
    for i, c in enumerate(combiners):
        if c not in SUPPORTED_COMBINERS:
            raise ValueError(f"Invalid `combiners[{i}]`: {c!r}, use one of "
                             f"{', '.join(SUPPORTED_COMBINERS)}.")
    if sp_weights is None:
        sp_weights = [None] * n
    if not isinstance(sp_weights, (list, tuple)):
        raise TypeError(f"`sp_weights` must be None or a list of {n} "
                        "entries (None allowed per entry), got "
                        f"{type(sp_weights).__name__}.")
    if len(sp_weights) != n:
        raise ValueError(f"`sp_weights` must be None or a list of {n} "
                         "entries (None allowed per entry), got "
                         f"{len(sp_weights)}.")
    if partition_strategy not in PARTITION_STRATEGIES:
        raise ValueError(f"Invalid `partition_strategy`: "
                         f"{partition_strategy!r}, use one of "
                         f"{', '.join(PARTITION_STRATEGIES)}.")
    if (not isinstance(params_num_per_group, int)
            or params_num_per_group < 1):
        raise ValueError("`params_num_per_group` must be a positive int, got "
                         f"{params_num_per_group!r}.")
    return list(params), list(sp_ids), list(combiners), list(sp_weights)


def _check_ids_dtype(ids_dtype: tf.DType, name: str) -> None:
    if not ids_dtype.is_integer:
        raise TypeError(f"`{name}` must hold int32 or int64 ids, got "
                        f"{ids_dtype.name}.")


def _check_weights(weights: Any, ids: Any, name: str) -> None:
    """Checks the kind and dtype of one weight tensor against its ids."""
    if weights is None:
        return
    kind = type(ids).__name__
    if type(weights) is not type(ids):
        raise TypeError(f"`{name}` must be a {kind} like its ids, got "
                        f"{type(weights).__name__}.")
    if not weights.dtype.is_floating:
        raise TypeError(f"`{name}` must hold float weights, got "
                        f"{weights.dtype.name}.")


def to_feature_ids(sp_ids: Sequence[Any], sp_weights: Sequence[Any],
                   need_positions: bool = False,
                   same_batch: bool = True) -> List[FeatureIds]:
    """Converts every id feature to `FeatureIds`, checking it on the way.

    SparseTensors (indices in any order, duplicates allowed) are converted
    together, once per feature; RaggedTensors are used as they are.

    Args:
        sp_ids: SparseTensor or RaggedTensor ids, one per feature.
        sp_weights: None or matching float weights, one per feature.
        need_positions: also compute each id's slot in its row.
        same_batch: require one batch size for all features (checked
            statically, else at run time).

    Raises:
        TypeError: ids not integer, weights not float, unsupported kind.
        ValueError: SparseTensor of rank != 2, RaggedTensor not 2-D, or
            batch sizes that differ between features (when static).
    """
    if all(isinstance(ids, FeatureIds) for ids in sp_ids):
        # Already converted (packed ids: one batch, checked on unpacking).
        return list(sp_ids)
    feats: List[Optional[FeatureIds]] = [None] * len(sp_ids)
    sparse_at = []
    for i, (ids, w) in enumerate(zip(sp_ids, sp_weights)):
        name = f"sp_ids[{i}]"
        _check_weights(w, ids, f"sp_weights[{i}]")
        if isinstance(ids, tf.SparseTensor):
            _check_ids_dtype(ids.dtype, name)
            rank = ids.shape.rank
            if rank is None:
                rank = tf.compat.dimension_value(ids.indices.shape[1])
            if rank is not None and rank != 2:
                raise ValueError(f"`{name}` must be a rank-2 SparseTensor "
                                 f"[batch, ids per row], got rank {rank}.")
            sparse_at.append(i)
        elif isinstance(ids, tf.RaggedTensor):
            _check_ids_dtype(ids.dtype, name)
            if ids.ragged_rank != 1 or ids.shape.rank != 2:
                raise ValueError(f"`{name}` must be a 2-D RaggedTensor "
                                 f"[batch, None], got shape {ids.shape}.")
            feats[i] = ragged_ids.from_ragged(ids, w, name, need_positions)
        else:
            raise TypeError(f"`{name}` must be a SparseTensor or "
                            f"RaggedTensor, got {type(ids).__name__}.")
    batch_checked = False
    if sparse_at:
        # All SparseTensors: the conversion op can check the batch sizes
        # (one check instead of a few graph ops per feature).
        converted, batch_checked = ragged_ids.from_sparse(
            [sp_ids[i] for i in sparse_at],
            [sp_weights[i] for i in sparse_at],
            [f"sp_ids[{i}]" for i in sparse_at], need_positions,
            same_batch=same_batch and len(sparse_at) == len(sp_ids))
        for i, f in zip(sparse_at, converted):
            feats[i] = f
    # Every entry is set: ragged ones above, sparse ones here.
    converted_all = [f for f in feats if f is not None]
    if (same_batch and not _check_batch_sizes(sp_ids)
            and not batch_checked):
        return _assert_same_batch(converted_all)
    return converted_all


def _static_batch(ids: Any) -> Optional[int]:
    if isinstance(ids, tf.SparseTensor):
        value = tf.get_static_value(ids.dense_shape[0])
    else:
        value = tf.compat.dimension_value(ids.shape[0])
    return None if value is None else int(value)


def _check_batch_sizes(sp_ids: Sequence[Any]) -> bool:
    """Rejects statically known batch sizes that differ between features.

    Returns:
        True if every batch size was known statically (nothing left to
        check at run time).
    """
    first = None
    all_static = True
    for i, ids in enumerate(sp_ids):
        b = _static_batch(ids)
        if b is None:
            all_static = False
            continue
        if first is None:
            first = (i, int(b))
        elif int(b) != first[1]:
            raise ValueError(
                f"`sp_ids[{i}]` has batch size {int(b)} but "
                f"`sp_ids[{first[0]}]` has {first[1]}; all features of one "
                "lookup must share the batch.")
    return all_static


def _assert_same_batch(feats: List[FeatureIds]) -> List[FeatureIds]:
    """Makes every feature's ids depend on ONE batch-size check.

    The per-feature asserts that name the feature are built only in the
    branch taken when the check fails. Every lookup path consumes the ids,
    so none runs on mismatched batches.
    """
    if len(feats) < 2:
        return feats
    sizes = [ragged_ids.batch_size(f) for f in feats]
    same = tf.reduce_all(tf.equal(tf.stack(sizes[1:]), sizes[0]))

    def _fail() -> tf.Tensor:
        checks = [tf.debugging.assert_equal(
            size, sizes[0],
            message=f"`{f.name}` has a different batch size than "
                    f"`{feats[0].name}`.")
            for f, size in zip(feats[1:], sizes[1:])]
        with tf.control_dependencies(checks):
            return tf.constant(False)

    valid = tf.cond(same, lambda: tf.constant(True), _fail)
    with tf.control_dependencies([valid]):
        return [dataclasses.replace(f, values=tf.identity(f.values))
                for f in feats]
