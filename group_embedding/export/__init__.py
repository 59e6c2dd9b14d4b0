"""The serving export: SavedModels that plain TensorFlow loads and serves.

`saved_model` holds `ge.export_saved_model`; `ev_snapshot` an
EmbeddingVariable's content as stock TF ops (the one snapshot of an EV, as
variables of a TF2 SavedModel or constants of a frozen TF1 graph);
`frozen_graph` freezes a TF1 session graph and writes it (what
`Estimator.export_saved_model` and the TF1 form of `export_saved_model`
write); `keras_serving` a Keras model's endpoints typed by its inputs.

The estimator (`Estimator.export_saved_model`) and the collective mode
(`ge.export_from_checkpoint`, distributed/export.py) call into this
package; it imports neither.
"""

from group_embedding.export.saved_model import export_saved_model

__all__ = ["export_saved_model"]
