"""Writes an inference graph as a SavedModel that plain TF serves.

The graph built by `model_fn` in PREDICT mode is restored from a
checkpoint, its EmbeddingVariable reads are replaced by stock-TF snapshots
(`ev_snapshot`), and its variables are folded into constants
(`convert_variables_to_constants`, which also drops every op the outputs
do not need, e.g. the EV storage). The result, with the snapshot tables'
initializer as `main_op`, is written with the TF1 `SavedModelBuilder`.
"""

import contextlib
import os
import time
from typing import Dict

import tensorflow as tf

from group_embedding.estimator import ev_snapshot
from group_embedding.estimator.export import PredictOutput
from group_embedding.ops import kernel_library

_v1 = tf.compat.v1
DEFAULT_SIGNATURE = "serving_default"
_KERNELS_ENV = "GROUP_EMBEDDING_KERNELS"


@contextlib.contextmanager
def pure_tf_lookups():
    """Builds lookups on the pure-TF path (read on every lookup): EV rows
    then come from `GroupEmbeddingEVGather`, which `ev_snapshot` replaces, and
    plain tables from stock gathers instead of the C++ fused op."""
    previous = os.environ.get(_KERNELS_ENV)
    os.environ[_KERNELS_ENV] = "tf"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_KERNELS_ENV]
        else:
            os.environ[_KERNELS_ENV] = previous


def signature_outputs(export_outputs, predictions
                      ) -> Dict[str, Dict[str, tf.Tensor]]:
    """Signature name -> output name -> tensor.

    Raises:
        TypeError: an export output is not a `PredictOutput`.
    """
    if not export_outputs:
        export_outputs = {DEFAULT_SIGNATURE: PredictOutput(predictions)}
    out = {}
    for name, output in export_outputs.items():
        if not isinstance(output, PredictOutput):
            raise TypeError(
                f"`export_outputs['{name}']` must be an "
                "estimator.export.PredictOutput, got "
                f"{type(output).__name__}.")
        out[name] = output.outputs
    return out


def is_library_op(op_type: str) -> bool:
    """Whether `op_type` is an op of this library (plain TF lacks it)."""
    module = kernel_library.library()
    # The loaded op module has one CamelCase wrapper per op it registers.
    return module is not None and op_type[:1].isupper() and callable(
        getattr(module, op_type, None)) and op_type not in dir(tf.raw_ops)


def freeze(graph: tf.Graph, session, fetches) -> tf.compat.v1.GraphDef:
    """A GraphDef computing `fetches` with stock ops and no variables.

    Args:
        graph: the restored inference graph.
        session: its session, with variables restored.
        fetches: the tensors that must stay computable.

    Returns:
        The frozen GraphDef (snapshot table initializers included).

    Raises:
        NotImplementedError: an op of this library is still needed (e.g.
            a collective lookup), so plain TF could not load the result.
    """
    ev_snapshot.replace_ev_gathers(graph, session)
    keep = sorted({t.op.name for t in fetches} | {
        op.name for op in graph.get_collection(
            _v1.GraphKeys.TABLE_INITIALIZERS)})
    frozen = _v1.graph_util.convert_variables_to_constants(
        session, graph.as_graph_def(), keep)
    leftover = sorted({n.op for n in frozen.node if is_library_op(n.op)})
    if leftover:
        raise NotImplementedError(
            "The exported graph still needs group_embedding ops "
            f"{', '.join(leftover)}, which plain TF cannot load.")
    return frozen


def write(frozen, receiver_tensors, outputs, table_init_names,
          export_dir_base: str, as_text: bool = False) -> bytes:
    """Writes `frozen` as `<export_dir_base>/<timestamp>/`.

    Args:
        frozen: GraphDef from `freeze`.
        receiver_tensors: dict input name -> tensor name in `frozen`.
        outputs: signature name -> output name -> tensor name.
        table_init_names: op names to run at load (`main_op`).
        export_dir_base: parent directory of the timestamped export.
        as_text: write `saved_model.pbtxt` instead of `.pb`.

    Returns:
        The export directory, as bytes (as stock returns it).
    """
    os.makedirs(export_dir_base, exist_ok=True)
    stamp = int(time.time())
    while os.path.exists(os.path.join(export_dir_base, str(stamp))):
        stamp += 1
    final = os.path.join(export_dir_base, str(stamp))
    write_to(frozen, receiver_tensors, outputs, table_init_names, final,
             as_text, os.path.join(export_dir_base, f"temp-{stamp}"))
    return final.encode()


def write_to(frozen, receiver_tensors, outputs, table_init_names,
             export_dir: str, as_text: bool = False, temp=None):
    """Writes `frozen` as the SavedModel `export_dir` (arguments as for
    `write`), through the folder `temp` (default `<export_dir>.partial`)
    renamed at the end, so that readers never see half an export."""
    temp = temp or export_dir + ".partial"
    with tf.Graph().as_default() as graph:
        _v1.import_graph_def(frozen, name="")

        def info(name):
            return _v1.saved_model.utils.build_tensor_info(
                graph.get_tensor_by_name(name))

        inputs = {k: info(v) for k, v in receiver_tensors.items()}
        signatures = {
            name: _v1.saved_model.signature_def_utils.build_signature_def(
                inputs, {k: info(v) for k, v in outs.items()},
                _v1.saved_model.signature_constants.PREDICT_METHOD_NAME)
            for name, outs in outputs.items()}
        main_op = tf.group(*[graph.get_operation_by_name(n)
                             for n in table_init_names], name="main_op")
        with _v1.Session(graph=graph) as session:
            builder = _v1.saved_model.Builder(temp)
            builder.add_meta_graph_and_variables(
                session, [_v1.saved_model.tag_constants.SERVING],
                signature_def_map=signatures, main_op=main_op,
                strip_default_attrs=True)
            builder.save(as_text=as_text)
    # Readers never see a half-written export (stock does the same).
    os.rename(temp, export_dir)
