"""The estimator_cases model trained and evaluated by an Estimator in
collective mode; each worker feeds its slice of every global batch.

Worker 0 writes the evaluation metrics and dense weights to OUT (JSON);
test_collective_estimator.py compares -np 2 with -np 1.

    horovodrun -np 2 python collective_estimator.py --model-dir D --out F
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# estimator_cases: the model shared with the single-process estimator tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                os.pardir, "estimator"))

import numpy as np  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding import estimator as ge_estimator  # noqa: E402

import estimator_cases as cases  # noqa: E402


def local_slice(features, labels, rank, size):
    """This worker's rows of every global batch of `cases.BATCH`."""
    per = cases.BATCH // size
    rows = np.concatenate([
        np.arange(start + rank * per, start + (rank + 1) * per)
        for start in range(0, len(labels), cases.BATCH)])
    return {k: v[rows] for k, v in features.items()}, labels[rows], per


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy("collective")
    rank, size = hvd.rank(), hvd.size()
    features, labels, per = local_slice(*cases.make_data(96), rank, size)
    test_features, test_labels, _ = local_slice(
        *cases.make_data(64, seed=1), rank, size)
    est = ge_estimator.Estimator(
        cases.model_fn, args.model_dir,
        ge_estimator.RunConfig(log_step_count_steps=None),
        {"lr": 0.2, "collective": True})
    est.train(cases.input_fn(features, labels, batch=per), steps=2)
    est.train(cases.input_fn(features, labels, batch=per))  # resumes
    result = est.evaluate(cases.input_fn(test_features, test_labels,
                                         batch=per))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"metrics": {k: float(v) for k, v in result.items()},
                       "w": est.get_variable_value("w").tolist(),
                       "checkpoint": est.latest_checkpoint()}, f)
    print(f"worker {rank}/{size}: {result}", flush=True)


if __name__ == "__main__":
    main()
