"""Stops a stock `tf.compat.v1.train` optimizer from silently skipping
the EmbeddingVariables of a TF1 graph.

A stock TF1 optimizer's `minimize(loss)` (or `compute_gradients(loss)`)
without `var_list` trains TRAINABLE_VARIABLES plus the graph's
TRAINABLE_RESOURCE_VARIABLES collection. EVs are in neither (they are no
`tf.Variable`), so a model with dense weights trained its dense part
while its EVs kept their initial rows, without a word. DeepRec's stock
optimizers train EVs; ours cannot (they update dense rows, not keys).

So each trainable EV built in a graph puts a `StockOptimizerGuard` in
TRAINABLE_RESOURCE_VARIABLES (which only that optimizer code reads). The
stock optimizer takes it as a resource variable: the gradient of the loss
is taken with respect to the EV's handle, and when the loss reads the EV
(the gradient is not None) the optimizer's dtype check reads the guard's
`dtype`, which raises a `TypeError` naming the EV and the fix. A loss that
does not read the EV gets no gradient for it and trains as before; a
`var_list` passed by the user is taken as it is; `ge.train` optimizers
collect EVs themselves and never read the collection.

A MetaGraph export writes each guard as a marked VariableDef (the EV's
name and handle), which the import turns back into a guard of the
imported handle.
"""

import tensorflow as tf
from tensorflow.core.framework import variable_pb2
from tensorflow.python.framework import ops as tf_ops

_KEY = tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES
# A guard's VariableDef: this prefix and the EV's name as snapshot_name,
# its handle as variable_name.
_MARK = "group_embedding/stock_optimizer_guard/"


class StockOptimizerGuard:
    """What a stock TF1 optimizer sees of a trainable EV (see module
    docstring): resource-variable-like, refusing at its dtype check."""

    # Read by TF's `is_resource_variable` and `gradients` (via `.handle`).
    _should_act_as_resource_variable = True
    # Makes `_get_processor` take it without reading `.op`.
    _in_graph_mode = False

    def __init__(self, ev_name: str, handle: tf.Tensor):
        self._ev_name = ev_name
        self._handle = handle

    @property
    def handle(self) -> tf.Tensor:
        return self._handle

    @property
    def name(self) -> str:
        return self._ev_name

    @property
    def dtype(self):
        # A stock optimizer reads it only for variables the loss has a
        # gradient for: the EV would be skipped silently.
        raise TypeError(
            f"EmbeddingVariable '{self._ev_name}' is read by the loss, but "
            "a stock tf.compat.v1.train optimizer would leave it "
            "untrained (it updates plain variables only): use a ge.train "
            "optimizer (GradientDescentOptimizer, AdagradOptimizer, "
            "AdagradDecayOptimizer, AdamOptimizer, AdamAsyncOptimizer, "
            "FtrlOptimizer), or pass `var_list` to say which variables "
            "this optimizer trains.")

    def __repr__(self):
        return f"<StockOptimizerGuard of EmbeddingVariable '{self._ev_name}'>"


def add_guard(ev) -> None:
    """Puts `ev`'s guard in the default graph's collection (graph mode,
    trainable EVs only)."""
    if tf.executing_eagerly() or not ev.trainable:
        return
    tf.compat.v1.add_to_collection(_KEY,
                                   StockOptimizerGuard(ev.name, ev.handle))


def _to_proto(item, export_scope=None):
    """A guard as a marked VariableDef; the collection's variables as TF
    exports variables."""
    if not isinstance(item, StockOptimizerGuard):
        return item.to_proto(export_scope=export_scope)
    if export_scope and not item.handle.name.startswith(export_scope):
        return None
    return variable_pb2.VariableDef(
        variable_name=tf_ops.strip_name_scope(item.handle.name, export_scope),
        snapshot_name=_MARK + tf_ops.strip_name_scope(item.name, export_scope),
        is_resource=True)


def _from_proto(proto, import_scope=None):
    """Inverse of `_to_proto`."""
    if not proto.snapshot_name.startswith(_MARK):
        # Another variable: imported as TRAINABLE_VARIABLES' entries are.
        return tf_ops.get_from_proto_function(
            tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)(
                proto, import_scope=import_scope)
    graph = tf.compat.v1.get_default_graph()
    return StockOptimizerGuard(
        tf_ops.prepend_name_scope(proto.snapshot_name[len(_MARK):],
                                  import_scope),
        graph.as_graph_element(
            tf_ops.prepend_name_scope(proto.variable_name, import_scope)))


def _register_proto_functions():
    """Without it a MetaGraph export would name each guard as a graph
    node (none is) and drop the whole collection with a warning."""
    if tf_ops.get_to_proto_function(_KEY) is None:
        tf_ops.register_proto_function(
            _KEY, proto_type=variable_pb2.VariableDef, to_proto=_to_proto,
            from_proto=_from_proto)


_register_proto_functions()
