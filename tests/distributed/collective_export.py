"""Exports, from one plain process, the tables a collective run saved.

    horovodrun -np 2 python collective_checkpoint.py --phase save --dir D
    python collective_export.py --dir D --out EXPORT

The tables of collective_checkpoint.py (row-sharded, table-wise and
replicated dense tables, an EV sharded by key) are built here without
Horovod, restored from the N-worker checkpoint (`ge.restore_tables` reads
any worker count), checked against the probe lookups the collective run
recorded, and written with `ge.export_from_checkpoint`: ONE servable artifact
holding every shard's rows, with stock TF ops only.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import collective_checkpoint as cc  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    tables = cc.build(1000)  # other initial values than the saved ones
    probe = cc.batch(7)
    spec = {name: tf.RaggedTensorSpec([None, None], ids.dtype, 1,
                                      ids.row_splits.dtype)
            for name, ids in probe.items()}
    module = tf.Module()
    module.tables = tables
    module.serve = tf.function(
        lambda ids: cc.lookup(tables, ids, training=False),
        input_signature=[spec], autograph=False)
    # One call: every worker's shards restored here, then exported.
    ge.export_from_checkpoint(args.dir, tables, module, args.out)
    want = np.load(os.path.join(args.dir, "expected.npy"))
    np.testing.assert_allclose(
        cc.lookup(tables, probe, training=False).numpy(), want, rtol=1e-6,
        atol=1e-7)
    print("exported the restored tables: single process equals the "
          "collective run", flush=True)


if __name__ == "__main__":
    main()
