"""`ModeKeys`: the modes in which an Estimator calls its `model_fn`."""


class ModeKeys:
    """The values of `tf.estimator.ModeKeys` (TF 1.15 / 2.x).

    `model_fn(features, labels, mode, ...)` receives one of them:
    `TRAIN` from `Estimator.train`, `EVAL` from `evaluate`, `PREDICT`
    from `predict` and `export_saved_model`.
    """

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


SUPPORTED_MODES = (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)
