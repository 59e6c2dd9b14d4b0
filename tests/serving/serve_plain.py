"""Serves a SavedModel with plain TensorFlow in a process that cannot
import group_embedding, and writes its predictions.

    python serve_plain.py EXPORT_DIR REQUESTS.npz OUT.npz ENDPOINT

REQUESTS.npz holds per input NAME either `NAME` (dense), `NAME.values` and
`NAME.row_splits` (ragged) or `NAME.indices`, `NAME.values`,
`NAME.dense_shape` (sparse). ENDPOINT "serve" calls the `serve` function
(of `model.export()` or `ge.export_saved_model(model)`) with the dict of
inputs; "serving_default" calls that signature: by input name, a ragged
or sparse input as its dense parts as `ge.export_saved_model` documents
them (`NAME_values`, `NAME_row_splits`; `NAME_indices`, `NAME_values`,
`NAME_dense_shape`), or (as `tf.saved_model.save(model)` names them)
`inputs`, `inputs_1`, ... in the order of the sorted input names.
"""

import importlib.util
import os
import sys

# The editable install of this checkout is found through a meta path
# finder and the script's folder may sit inside the checkout: remove both,
# so that the library cannot be imported at all.
sys.meta_path = [f for f in sys.meta_path
                 if "group_embedding" not in type(f).__module__
                 and "group_embedding" not in getattr(f, "__module__", "")]
sys.path = [p for p in sys.path
            if not os.path.isdir(os.path.join(p or ".", "group_embedding"))]
sys.path_importer_cache.clear()
if importlib.util.find_spec("group_embedding") is not None:
    sys.exit("group_embedding is importable")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def inputs(arrays):
    out = {}
    for key, value in arrays.items():
        name, _, part = key.partition(".")
        out.setdefault(name, {})[part] = value
    result = {}
    for name, parts in out.items():
        if "" in parts:
            result[name] = tf.constant(parts[""])
        elif "row_splits" in parts:
            result[name] = tf.RaggedTensor.from_row_splits(
                parts["values"], parts["row_splits"])
        else:
            result[name] = tf.SparseTensor(parts["indices"],
                                           parts["values"],
                                           parts["dense_shape"])
    return result


def parts(features):
    """Ragged and sparse inputs as the dense tensors of their parts."""
    out = {}
    for name, value in features.items():
        if isinstance(value, tf.RaggedTensor):
            out[name + "_values"] = value.values
            out[name + "_row_splits"] = value.row_splits
        elif isinstance(value, tf.SparseTensor):
            out[name + "_indices"] = value.indices
            out[name + "_values"] = value.values
            out[name + "_dense_shape"] = value.dense_shape
        else:
            out[name] = value
    return out


def main():
    path, requests, out, endpoint = sys.argv[1:5]
    features = inputs(dict(np.load(requests, allow_pickle=True)))
    loaded = tf.saved_model.load(path)
    if endpoint == "serve":
        spec = loaded.serve.concrete_functions[0].structured_input_signature
        single = not isinstance(spec[0][0], dict)
        result = loaded.serve(next(iter(features.values())) if single
                              else features)
    else:
        signature = loaded.signatures[endpoint]
        names = signature.structured_input_signature[1]
        if set(names) == set(parts(features)):
            features = parts(features)
        elif set(names) != set(features):  # Keras: inputs, inputs_1, ...
            names = sorted(names, key=lambda n: int(n.rpartition("_")[2])
                           if "_" in n else 0)
            features = {n: features[k] for n, k in
                        zip(names, sorted(features))}
        result = signature(**features)
        result = list(result.values())[0]
    if any(m.startswith("group_embedding") for m in sys.modules):
        sys.exit("group_embedding was imported")
    np.save(out, np.asarray(result))


if __name__ == "__main__":
    main()
