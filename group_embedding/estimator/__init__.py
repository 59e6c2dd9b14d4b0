"""`tf.estimator` for TF 2.21, on `tf.compat.v1.train.MonitoredTrainingSession`.

TF 2.16+ ships no `tf.estimator` (and `tensorflow-estimator` does not import
with TF 2.21). This package gives DeepRec-style Estimator scripts the stock
names; `import group_embedding.compat` installs it as `tf.estimator` (and
`tf.compat.v1.estimator`) when TF has none.

    import group_embedding as ge
    est = ge.estimator.Estimator(model_fn, model_dir, params=params)
"""

from group_embedding.estimator import export
from group_embedding.estimator.estimator import Estimator
from group_embedding.estimator.estimator_spec import EstimatorSpec
from group_embedding.estimator.mode_keys import ModeKeys
from group_embedding.estimator.run_config import RunConfig
from group_embedding.estimator.training import EvalSpec
from group_embedding.estimator.training import TrainSpec
from group_embedding.estimator.training import train_and_evaluate

__all__ = [
    "Estimator",
    "EstimatorSpec",
    "EvalSpec",
    "ModeKeys",
    "RunConfig",
    "TrainSpec",
    "export",
    "train_and_evaluate",
]
