"""A TF1 inference graph frozen into stock TF and written as a SavedModel.

The graph (an Estimator's `model_fn` in PREDICT mode, or any session's
graph given to `ge.export_saved_model(None, ..., session=)`) is restored
from a checkpoint, its EmbeddingVariable reads are replaced by stock-TF
snapshots (`replace_ev_gathers`, constants from `ev_snapshot`), and its
variables are folded into constants (`convert_variables_to_constants`,
which also drops every op the outputs do not need, e.g. the EV storage).
The result, with the snapshot tables' initializer as `main_op`, is written
with the TF1 `SavedModelBuilder`.
"""

import contextlib
import os
import time
from typing import List

import tensorflow as tf

from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.export import ev_snapshot
from group_embedding.ops import config
from group_embedding.ops import kernel_library
from group_embedding.ops import op_names

_v1 = tf.compat.v1
DEFAULT_SIGNATURE = "serving_default"
EV_GATHER_OPS = op_names.with_alias("GroupEmbeddingEVGather")


@contextlib.contextmanager
def pure_tf_lookups():
    """Builds lookups on the pure-TF path (read on every lookup): EV rows
    then come from `GroupEmbeddingEVGather`, which `replace_ev_gathers`
    replaces, and plain tables from stock gathers instead of the C++
    fused op."""
    with config.kernel_mode_set(config.KernelMode.TF):
        yield


def is_library_op(op_type: str) -> bool:
    """Whether `op_type` is an op of this library (plain TF lacks it)."""
    module = kernel_library.library()
    # The loaded op module has one CamelCase wrapper per op it registers.
    return module is not None and op_type[:1].isupper() and callable(
        getattr(module, op_type, None)) and op_type not in dir(tf.raw_ops)


def snapshot_of(ev: EmbeddingVariable,
                session) -> ev_snapshot.EmbeddingSnapshot:
    """Reads `ev` in `session` and builds its snapshot (constants) in the
    current graph."""
    keys, values, _, freqs = session.run(ev.export())
    defaults = session.run(ev.default_values)
    return ev_snapshot.from_arrays(ev, keys, values, freqs, defaults,
                                   as_variables=False)


def replace_ev_gathers(graph: tf.Graph, session) -> int:
    """Makes every consumer of an `GroupEmbeddingEVGather` op read snapshots.

    Args:
        graph: the inference graph (built with `training=False` lookups on
            the pure-TF path, `GROUP_EMBEDDING_KERNELS=tf`, so that EV rows
            come from `GroupEmbeddingEVGather`).
        session: a session of `graph` holding the restored EVs.

    Returns:
        The number of ops replaced.

    Raises:
        ValueError: an op reads an EV that is not in the graph's
            SAVEABLE_OBJECTS collection.
    """
    evs = {ev.handle.name: ev for ev in graph.get_collection(
        tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS)
        if is_embedding_variable(ev)}
    snapshots = {}
    gathers: List[tf.Operation] = [op for op in graph.get_operations()
                                   if op.type in EV_GATHER_OPS]
    with graph.as_default():
        for op in gathers:
            k = (len(op.inputs) - 1) // 3  # handles, keys, defaults, flag
            parts = []
            for handle, keys in zip(op.inputs[:k], op.inputs[k:2 * k]):
                ev = evs.get(handle.name)
                if ev is None:
                    raise ValueError(
                        f"Op '{op.name}' reads the EmbeddingVariable "
                        f"handle '{handle.name}', which is not in the "
                        "graph's SAVEABLE_OBJECTS collection.")
                if ev.name not in snapshots:
                    with tf.compat.v1.name_scope("ev_snapshot"):
                        snapshots[ev.name] = snapshot_of(ev, session)
                with tf.compat.v1.name_scope(op.name + "_snapshot"):
                    parts.append(snapshots[ev.name].lookup(keys))
            rows = parts[0] if k == 1 else tf.concat(parts, 0)
            output = op.outputs[0]
            for consumer in list(output.consumers()):
                for i, tensor in enumerate(consumer.inputs):
                    if tensor is output:
                        # No public API rewires an existing op's input.
                        consumer._update_input(i, rows)  # noqa: SLF001
    return len(gathers)


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
    replace_ev_gathers(graph, session)
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
