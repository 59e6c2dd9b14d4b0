"""`ge.export_saved_model`: a SavedModel that plain TensorFlow serves.

TF2 objects (Keras models, `tf.Module`s) go through `tf.saved_model.save`,
which freezes every EmbeddingVariable it meets into stock TF ops
(ev_snapshot.py); `model.export()` does the same. This function saves
a Keras model with endpoints typed by its inputs (keras_serving.py: ragged
and sparse inputs stay so), checks that the written graph needs no op of
this library, and frees the snapshots afterwards. TF1 graphs are frozen
from a session (frozen_graph.py, what `Estimator.export_saved_model`
writes).
"""

import os
import shutil
from typing import Dict
from typing import Optional
from typing import Set

import keras
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from group_embedding.export import ev_snapshot
from group_embedding.export import frozen_graph
from group_embedding.export import keras_serving


def export_saved_model(obj, export_dir: str, signatures=None,
                       options=None, *, session=None,
                       inputs: Optional[Dict[str, tf.Tensor]] = None,
                       outputs: Optional[Dict[str, tf.Tensor]] = None
                       ) -> str:
    """Writes a SavedModel whose EmbeddingVariables are frozen into stock
    TF ops: it loads and serves in a process without this library.

    Each EV is read once, when the export runs: its admitted keys' rows,
    the filter's `default_value_no_permission` for keys not admitted
    (under a `CounterFilter` / `CBFFilter`), and row `key mod
    default_value_dim` of its default matrix for other keys, exactly what
    a `training=False` lookup reads then. Plain tables and lookups become
    stock gathers and segment sums.

    Two forms:

    * TF2: `export_saved_model(model_or_module, export_dir, signatures,
      options)`, the arguments of `tf.saved_model.save` (which, like
      `model.export()`, freezes the EVs by itself; this adds the check
      below). Pass tf.functions as signatures, not concrete functions
      traced before: the save must trace them.
    * A Keras model with defined inputs and no `signatures` is saved as
      `keras_serving.KerasServing(model)`: a `serve` function taking the
      inputs as the model does, each as its kind of tensor (a
      `keras.Input(ragged=True)` a `tf.RaggedTensor`, `sparse=True` a
      `tf.SparseTensor`), and a `serving_default` signature of dense
      tensors named after the inputs (`NAME`; `NAME_values` and
      `NAME_row_splits` of a ragged input; `NAME_indices`, `NAME_values`
      and `NAME_dense_shape` of a sparse one). Keras' own `model.export()`
      types every input dense.
    * TF1: `export_saved_model(None, export_dir, session=sess,
      inputs={name: tensor}, outputs={name: tensor})` freezes the graph of
      `sess` (variables become constants) into a `serving_default`
      predict signature. Build that inference graph with
      `GROUP_EMBEDDING_KERNELS=tf` and `training=False` lookups (EV rows
      then come from `GroupEmbeddingEVGather` ops, which are replaced), as
      `Estimator.export_saved_model` does.

    Args:
        obj: the trackable object to save (TF2; a Keras model: see
            above), None for TF1.
        export_dir: the SavedModel folder (must not exist for TF1).
        signatures: as for `tf.saved_model.save`.
        options: a `tf.saved_model.SaveOptions`.
        session: TF1 session holding the trained variables.
        inputs: TF1 signature inputs (dense tensors).
        outputs: TF1 signature outputs (dense tensors).

    Returns:
        `export_dir`.

    Raises:
        NotImplementedError: the written graph still needs an op of this
            library (e.g. a collective lookup); nothing is left at
            `export_dir`.
        ValueError: TF1 form without `inputs` / `outputs`, or with `obj`;
            a Keras model whose inputs' serving tensor names collide.
    """
    if session is None:
        if isinstance(obj, keras.Model) and signatures is None and \
                keras_serving.model_inputs(obj) is not None:
            obj = keras_serving.KerasServing(obj)
            signatures = obj.signatures()
        try:
            tf.saved_model.save(obj, export_dir, signatures=signatures,
                                options=options)
        except AssertionError as e:
            if "group_embedding::ev::EVStorage" not in str(e):
                raise
            # A function traced before the save reads an EV's storage.
            shutil.rmtree(export_dir, ignore_errors=True)
            raise NotImplementedError(_LIBRARY_OPS_MESSAGE.format(
                path=export_dir, ops="EV storage reads")) from e
        finally:
            ev_snapshot.release()
        _check_stock_ops(export_dir)
        return export_dir
    if obj is not None or not inputs or not outputs:
        raise ValueError("A TF1 export takes obj=None, a session and "
                         "non-empty `inputs` and `outputs` dicts.")
    frozen = frozen_graph.freeze(
        session.graph, session, list(outputs.values()))
    frozen_graph.write_to(
        frozen, {k: t.name for k, t in inputs.items()},
        {frozen_graph.DEFAULT_SIGNATURE:
         {k: t.name for k, t in outputs.items()}}, [], export_dir)
    return export_dir


def _check_stock_ops(export_dir: str):
    """Removes the export and raises if its graph needs library ops."""
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    used: Set[str] = set()
    for meta in proto.meta_graphs:
        used.update(n.op for n in meta.graph_def.node)
        for function in meta.graph_def.library.function:
            used.update(n.op for n in function.node_def)
    leftover = sorted(op for op in used if frozen_graph.is_library_op(op))
    if leftover:
        shutil.rmtree(export_dir, ignore_errors=True)
        raise NotImplementedError(_LIBRARY_OPS_MESSAGE.format(
            path=export_dir, ops=", ".join(leftover)))


_LIBRARY_OPS_MESSAGE = (
    "The SavedModel at {path} would need group_embedding ops ({ops}), "
    "which plain TF cannot load: a concrete function traced before the "
    "export (pass the tf.function itself, the save traces it with frozen "
    "tables) or a collective lookup.")
