"""The ONE preparation of a grouped lookup's inputs: checks and conversion.

`prepare_sparse` (for `group_embedding_lookup_sparse`) and `prepare_dense`
(for `group_embedding_lookup`) check every argument (list lengths, closed
choices, the tables, EmbeddingVariable key dtypes, packed ids, dense ids)
and convert the ids, so that a lookup reads prepare -> plan -> run. What
comes out is a `PreparedInputs`: the tables unwrapped, their names, and
every id feature in one ragged form, `FeatureIds` (int64 values grouped by
row + row_splits, optional float weights: what the fused kernels consume;
`ragged_ids.to_feature_ids` converts and checks each id batch). Errors
name the argument and its index.
"""

import dataclasses
import sys
from typing import Any
from typing import List
from typing import Sequence
from typing import Tuple
from typing import Union

import tensorflow as tf

from group_embedding import lookup_plan
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import Mode
from group_embedding.ops import ragged_ids
from group_embedding.ops import tf_variables
from group_embedding.ops.ragged_ids import FeatureIds
from group_embedding.packed_ids import PackedIds

SUPPORTED_COMBINERS = ("sum", "mean", "sqrtn")
PARTITION_STRATEGIES = ("mod", "div")


def unwrap_table(param: Any, index: int) -> Any:
    """Returns the `tf.Variable` behind `param` (Keras 3 variables wrap one).

    Raises:
        TypeError: if `param` is not a variable.
    """
    param = tf_variables.to_tf_variable(param)
    if lookup_plan.table_kind(param) != lookup_plan.TableKind.VARIABLE:
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




@dataclasses.dataclass(frozen=True)
class PreparedInputs:
    """A lookup's inputs, checked and converted: what the plan takes.

    Attributes:
        tables: the K tables, unwrapped (`tf.Variable`, EmbeddingVariable
            or ShardedVariable).
        names: their names for error messages (`params[i] (name)`).
        feats: their ids, one `FeatureIds` per table.
        combiners: one combiner per table.
        dense_ids: `group_embedding_lookup`'s K dense id tensors, whose
            shapes S_i shape its outputs; empty for sparse lookups.
    """

    tables: Tuple[Any, ...]
    names: Tuple[str, ...]
    feats: Tuple[FeatureIds, ...]
    combiners: Tuple[str, ...]
    dense_ids: Tuple[tf.Tensor, ...] = ()


def lookup_mode(is_sequence: bool, concat_outputs: bool) -> Mode:
    """The `Mode` of a sparse lookup call.

    Raises:
        ValueError: both `is_sequence` and `concat_outputs`.
    """
    if concat_outputs and is_sequence:
        raise ValueError("`concat_outputs=True` concatenates pooled [B, D] "
                         "outputs; it cannot be used with "
                         "`is_sequence=True`.")
    if is_sequence:
        return Mode.SEQUENCE
    return Mode.CONCAT if concat_outputs else Mode.POOLED


def prepare_tables(params: Sequence[Any]) -> Tuple[List[Any], List[str]]:
    """The unwrapped tables of `params` and their names (`unwrap_table`,
    `table_name`)."""
    tables = [unwrap_table(p, i) for i, p in enumerate(params)]
    return tables, [table_name(t, i) for i, t in enumerate(tables)]


def prepare_sparse(params: Any, sp_ids: Union[Sequence[Any], PackedIds],
                   combiners: Any, sp_weights: Any, call: LookupCall,
                   params_num_per_group: int) -> PreparedInputs:
    """Checks and converts the arguments of `group_embedding_lookup_sparse`.

    Args:
        params, sp_ids, combiners, sp_weights, params_num_per_group: as
            `group_embedding_lookup_sparse` takes them (`sp_ids` a list of
            SparseTensor / RaggedTensor, or a `PackedIds`).
        call: the call's settings (its mode says whether each id's slot
            in its row is needed; its partition strategy is checked).

    Returns:
        The `PreparedInputs`.

    Raises:
        TypeError / ValueError: as `group_embedding_lookup_sparse`.
    """
    packed = None
    if isinstance(sp_ids, PackedIds):
        packed = _check_packed(params, sp_ids, sp_weights)
        sp_ids, sp_weights = [packed.values] * len(params), None
    params, sp_ids, combiners, sp_weights = check_lists(
        params, sp_ids, combiners, sp_weights, call.partition_strategy,
        params_num_per_group)
    _check_ev_keys(params, sp_ids, "sp_ids")
    need_positions = call.mode == Mode.SEQUENCE
    if packed is not None:
        feats = ragged_ids.from_packed(
            packed.values, packed.row_splits, packed.offsets, packed.batch,
            packed.weights if packed.weighted else None, len(params),
            need_positions)
        tables, names = prepare_tables(params)
    else:
        tables, names = prepare_tables(params)
        feats = ragged_ids.to_feature_ids(sp_ids, sp_weights,
                                          need_positions=need_positions,
                                          same_batch=True)
    return PreparedInputs(tuple(tables), tuple(names), tuple(feats),
                          tuple(combiners))


def prepare_dense(params: Any, ids: Any,
                  partition_strategy: str) -> PreparedInputs:
    """Checks and converts the arguments of `group_embedding_lookup`: each
    dense id tensor becomes a ragged batch of one-id rows (pooled with
    "sum", each row is its id's table row).

    Raises:
        TypeError / ValueError: as `group_embedding_lookup`.
    """
    if not isinstance(ids, (list, tuple)):
        raise TypeError("`ids` must be a list (one entry per table), got "
                        f"{type(ids).__name__}.")
    dense = []
    for i, x in enumerate(ids):
        if isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(f"`ids[{i}]` must be a dense tensor; use "
                            "group_embedding_lookup_sparse for "
                            f"{type(x).__name__} ids.")
        x = tf.convert_to_tensor(x)
        if isinstance(params, (list, tuple)) and i < len(params) \
                and is_embedding_variable(params[i]):
            params[i].check_keys(x, f"ids[{i}]")
        if not x.dtype.is_integer:
            raise TypeError(f"`ids[{i}]` must hold int32 or int64 ids, got "
                            f"{x.dtype.name}.")
        dense.append(x)
    params, ragged, combiners, weights = check_lists(
        params, [ragged_ids.one_id_rows(x) for x in dense], "sum", None,
        partition_strategy, sys.maxsize, ids_argument="ids")
    tables, names = prepare_tables(params)
    feats = ragged_ids.to_feature_ids(ragged, weights, same_batch=False)
    return PreparedInputs(tuple(tables), tuple(names), tuple(feats),
                          tuple(combiners), tuple(dense))


def _check_packed(params: Sequence[Any], packed: PackedIds,
                  sp_weights: Any) -> PackedIds:
    """Static checks of `PackedIds` ids against the tables."""
    if sp_weights is not None:
        raise ValueError("Packed `sp_ids` carry their weights: pass them to "
                         "`ge.pack_ids` and leave `sp_weights` None.")
    k = packed.num_features
    if k is not None and k != len(params):
        raise ValueError(f"Packed `sp_ids` hold {k} features but `params` "
                         f"has {len(params)} tables.")
    return packed


def _check_ev_keys(params: Sequence[Any], ids: Sequence[Any],
                   argument: str) -> None:
    # EmbeddingVariables check their own key dtype, so that the error
    # names the variable (int64 keys into an int32 EV, float keys).
    for i, (p, x) in enumerate(zip(params, ids)):
        if is_embedding_variable(p):
            p.check_keys(x, f"{argument}[{i}]")
