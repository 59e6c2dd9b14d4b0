"""DeepFM as a DeepRec-style Estimator script: `tf.estimator.Estimator`
(which TF 2.21 lacks; `import group_embedding.compat` installs
`ge.estimator` under that name) trains, resumes from its checkpoint,
evaluates with AUC and exports a SavedModel that plain TF serves.

The model_fn is the one of deepfm_tf1.py (26 EV columns with a
`CounterFilter` in one `group_embedding_column_scope`, FM + MLP,
`ge.train.AdagradOptimizer`), returned as a `tf.estimator.EstimatorSpec`.
The export turns the EV tables into stock `tf.lookup` tables, so
serve_saved_model.py serves it without this library.

    python tutorials/deepfm_estimator.py --rows 100000 --epochs 2
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

import group_embedding.compat  # noqa: F401  (adds tf.estimator)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (the tutorials' data generator, beside this file)
import deepfm_tf1  # noqa: E402

V1 = tf.compat.v1


def model_fn(features, labels, mode, params):
    """deepfm_tf1.model_fn, returning a `tf.estimator.EstimatorSpec`."""
    spec = deepfm_tf1.model_fn(features, labels, mode, params)
    return tf.estimator.EstimatorSpec(
        mode, predictions=spec.predictions, loss=spec.loss,
        train_op=spec.train_op, eval_metric_ops=spec.eval_metric_ops)


def serving_input_receiver_fn():
    """Requests carry the raw columns (CSV cells); the export parses them
    with the same `data.parse_raw` as training."""
    raw = {name: V1.placeholder(spec.dtype, [None], name=name)
           for name, spec in data.raw_signature().items()}
    return tf.estimator.export.ServingInputReceiver(data.parse_raw(raw),
                                                    raw)


def serve(export_dir, frame):
    """Probabilities from the SavedModel, served in a fresh process."""
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "serve_saved_model.py")
    with tempfile.TemporaryDirectory() as tmp:
        request = os.path.join(tmp, "request.csv")
        out = os.path.join(tmp, "probs.npy")
        data.write_csv(frame, request)
        subprocess.run([sys.executable, server, export_dir, request, out],
                       check=True)
        return np.load(out)


def main(argv=None):
    """Runs the tutorial; returns a dict of results (used by the tests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--filter-freq", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model_dir", default=None)
    args = parser.parse_args(argv)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="ge_deepfm_est_")
    os.makedirs(model_dir, exist_ok=True)
    frame, bayes_auc = data.generate(args.rows, seed=args.seed)
    split = int(0.8 * len(frame))
    train_csv = os.path.join(model_dir, "train.csv")
    valid_csv = os.path.join(model_dir, "valid.csv")
    data.write_csv(frame[:split], train_csv)
    data.write_csv(frame[split:], valid_csv)

    def train_input_fn():
        return data.to_dataset(train_csv, args.batch, shuffle=True,
                               seed=args.seed).repeat(args.epochs)

    def eval_input_fn():
        return data.to_dataset(valid_csv, args.batch)

    estimator = tf.estimator.Estimator(
        model_fn, model_dir, tf.estimator.RunConfig(
            tf_random_seed=args.seed, save_checkpoints_steps=200,
            log_step_count_steps=50),
        params={"dim": args.dim, "filter_freq": args.filter_freq,
                "hidden": args.hidden, "lr": args.lr})
    total = -(-split // args.batch) * args.epochs
    # Half the steps, then a second call that restores the checkpoint
    # (dense weights, EV keys, counts and Adagrad slots) and goes on.
    estimator.train(train_input_fn, max_steps=max(1, total // 2))
    first = estimator.evaluate(eval_input_fn)
    estimator.train(train_input_fn, max_steps=total)
    result = estimator.evaluate(eval_input_fn)
    print(f"AUC {first['auc']:.4f} at step {first['global_step']}, "
          f"{result['auc']:.4f} at step {result['global_step']} (hidden "
          f"truth {bayes_auc:.4f}); loss {result['loss']:.4f}")

    export_dir = estimator.export_saved_model(
        os.path.join(model_dir, "export"),
        serving_input_receiver_fn).decode()
    request = data.read_csv(valid_csv)[:500]
    predicted = np.array([p["probability"] for p in estimator.predict(
        lambda: data.to_dataset(request, args.batch))])
    served = serve(export_dir, request)
    diff = float(np.max(np.abs(served - predicted)))
    print(f"exported {export_dir}; served == Estimator.predict on "
          f"{len(request)} rows: max |difference| {diff:.2e}")
    if diff > 1e-5:
        sys.exit(f"served predictions differ from predict's by {diff}")
    return {"first": first, "final": result, "bayes_auc": bayes_auc,
            "total_steps": total, "export_dir": export_dir,
            "served": served, "predicted": predicted,
            "model_dir": model_dir}


if __name__ == "__main__":
    main()
