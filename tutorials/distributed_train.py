"""Tutorial (c): the DeepFM of deepfm_keras.py, trained on N workers.

Three additions to the single-process script make it model parallel:

1. `ge.enable_distributed_strategy("collective")` before building the
   model: the EV tables of the scoped columns now own the keys
   `key mod N` of this worker, and lookups exchange ids and rows with
   Horovod's all-to-all;
2. `ge.DistributedOptimizer(optimizer)`: dense gradients are averaged,
   table gradients stay with their owners;
3. `ge.broadcast_variables(model.variables)`: dense weights (and EV default
   rows) start equal on every worker.

Each worker reads its slice of the training rows (every N-th row); worker
0 prints the validation AUC.

    horovodrun -np 2 python tutorials/distributed_train.py --rows 100000
"""

import argparse
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import group_embedding as ge  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import deepfm_keras  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--vocab-cap", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024,
                        help="global batch, split over the workers")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--min-auc", type=float, default=0.0)
    args = parser.parse_args(argv)

    hvd = ge.enable_distributed_strategy("collective")
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(0)
    # Every worker generates the same data and keeps its own rows.
    frame, bayes_auc = data.generate(args.rows, args.vocab_cap, seed=0)
    split = int(0.8 * len(frame))
    local = frame[:split].iloc[rank::size]
    local_batch = args.batch // size
    train_ds = data.to_dataset(local, local_batch, shuffle=True, seed=rank)
    valid_ds = data.to_dataset(frame[split:], args.batch)

    config = {"dim": 8, "filter_freq": 2, "hidden": [128, 64]}
    model = deepfm_keras.build_model(config, next(iter(valid_ds))[0])
    ge.broadcast_variables(model.variables)
    optimizer = ge.DistributedOptimizer(
        ge.optimizers.Adagrad(args.lr, initial_accumulator_value=1e-3))
    history = deepfm_keras.train(
        model, train_ds, valid_ds, args.epochs,
        math.ceil(len(local) / local_batch), args.lr, optimizer=optimizer,
        verbose=2 if rank == 0 else 0)
    auc = history["val_auc"][-1]
    keys = sum(int(ev.size()) for ev in model.embedding_variables())
    print(f"worker {rank}/{size}: validation AUC {auc:.4f} (hidden truth "
          f"{bayes_auc:.4f}); this worker stores {keys} ids", flush=True)
    if auc < args.min_auc:
        sys.exit(f"validation AUC {auc:.4f} below --min-auc {args.min_auc}")


if __name__ == "__main__":
    main()
