"""Incremental checkpoints per shard in collective mode, restored at
another worker count (issue 26.2).

    horovodrun -np 2 python collective_incremental.py --phase save --dir D
    horovodrun -np M python collective_incremental.py --phase restore --dir D

`save`: every worker inserts and trains (Adagrad) keys it owns in EV
`tags` (GlobalStepEvict, so keys are evicted between saves) and changes
its rows of a mod-sharded dense table; it saves a full checkpoint and two
deltas (`full_every=3`), checks each delta holds only its own changed
keys and removals, and writes its final state (the oracle) to
D/expected-RANK.npz. `restore` (any M): restores the chain into fresh
tables, checks every worker holds exactly the saved keys it owns under M
with bitwise equal values, slots, freqs and versions, and dense rows
equal; then changes keys and saves again (`full_every=4`): a third delta
when M is the saving count, a full save otherwise; that save restores to
the live state.
"""

import argparse
import glob
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.ops import ev_storage  # noqa: E402

DIM = 8
SLOT = "adagrad/accumulator"
VOCAB = 97
SAVED_AT = 2


def build(seed):
    ev = ge.get_embedding_variable(
        f"tags{seed}", DIM, ev_option=ge.EmbeddingVariableOption(
            evict_option=ge.GlobalStepEvict(steps_to_live=1)))
    ev.ensure_slot(SLOT, 0.1)
    dense = ge.get_embedding_table("users", VOCAB, DIM, seed=seed,
                                   partition_strategy="mod",
                                   replicate=False)
    return {"tags": ev, "users": dense}


def dense_rows(table):
    """(global row ids, values) of this worker's part of a dense table
    (a plain variable when one worker runs)."""
    if isinstance(table, ge.ShardedVariable):
        return table.global_rows(), table.shard
    return np.arange(VOCAB), table


def state(ev):
    """An EV's content sorted by key (the oracle form of these tests,
    also used by test_incremental_checkpoint.py and incremental_kill.py),
    and its per-variable fields."""
    keys, values, freqs, versions, names, inits, slots, step = [
        np.asarray(x) for x in ev.storage.export(ev.handle,
                                                 ev.embedding_dim)]
    order = np.argsort(keys)
    names = np.asarray([n.decode() for n in names], dtype=str)
    return {"keys": keys[order], "values": values[order],
            "freqs": freqs[order], "versions": versions[order],
            "slots": slots[order], "slot_names": names, "slot_inits": inits,
            "step": step}


def assert_state(got, want, what):
    for field in want:
        np.testing.assert_array_equal(got[field], want[field],
                                      err_msg=f"{what}: {field}")


def train(tables, rng, step, rank, size):
    """Looks up and updates keys this worker owns at global step `step`;
    returns the keys it touched."""
    ev = tables["tags"]
    keys = rng.integers(-10**12, 10**12, 60)
    keys = keys[np.mod(keys, size) == rank]
    ev.lookup_rows(tf.constant(keys, tf.int64))
    update = np.unique(keys[:10])
    ev_storage.apply_adagrad(
        ev.handle, tf.constant(update, tf.int64),
        rng.standard_normal((len(update), DIM)).astype("f"), step, 0.3,
        1e-7, SLOT)
    _, shard = dense_rows(tables["users"])
    shard.assign_add(tf.fill(shard.shape, float(step)))
    return set(keys.tolist())


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def shard_of(path, rank, size):
    return dict(np.load(os.path.join(path, f"shard-{rank}-of-{size}.npz")))


def save(args, rank, size):
    tables = build(0)
    rng = np.random.default_rng(10 + rank)
    kinds = []
    for step in (1, 2, 3):
        before = set(state(tables["tags"])["keys"].tolist())
        touched = train(tables, rng, step, rank, size)
        path = ge.save_tables(args.dir, tables, step, full_every=3)
        kinds.append(manifest(path)["kind"])
        live = state(tables["tags"])
        if kinds[-1] == "delta":
            mine = shard_of(path, rank, size)
            alive = set(live["keys"].tolist())
            assert set(mine["tags/keys"].tolist()) == touched & alive
            assert set(mine["tags/removed"].tolist()) == \
                (before | touched) - alive
    assert kinds == ["full", "delta", "delta"], kinds
    rows, shard = dense_rows(tables["users"])
    np.savez(os.path.join(args.dir, f"expected-{rank}.npz"),
             rows=rows, dense=shard.numpy(), **live)
    print(f"worker {rank}/{size}: saved full + 2 deltas", flush=True)


def restore(args, rank, size):
    tables = build(1000)
    expected = [dict(np.load(f)) for f in
                sorted(glob.glob(os.path.join(args.dir, "expected-*.npz")))]
    assert len(expected) == SAVED_AT
    ge.restore_tables(args.dir, tables)
    # Every saved key this worker owns now, nothing else.
    want = {f: np.concatenate([e[f] for e in expected])
            for f in ("keys", "values", "freqs", "versions", "slots")}
    mine = np.mod(want["keys"], size) == rank
    order = np.argsort(want["keys"][mine])
    want = {f: v[mine][order] for f, v in want.items()}
    want["step"] = max(int(e["step"]) for e in expected)
    assert want["keys"].size > 0
    assert_state(state(tables["tags"]), want, f"worker {rank} restore")
    rows, shard = dense_rows(tables["users"])
    dense = np.zeros((VOCAB, DIM), "f")
    for e in expected:
        dense[e["rows"]] = e["dense"]
    np.testing.assert_array_equal(shard.numpy(), dense[rows])
    print(f"worker {rank}/{size}: restored the chain, states equal",
          flush=True)

    train(tables, np.random.default_rng(50 + rank), 4, rank, size)
    # K = 4: the chain (full + 2 deltas) may take a third delta.
    path = ge.save_tables(args.dir, tables, 4, full_every=4)
    kind = manifest(path)["kind"]
    assert kind == ("delta" if size == SAVED_AT else "full"), kind
    live = state(tables["tags"])
    again = build(2000)
    ge.restore_tables(path, again)
    assert_state(state(again["tags"]), live, f"worker {rank} resave")
    print(f"worker {rank}/{size}: saved again ({kind}), restores equal",
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "restore"])
    parser.add_argument("--dir")
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy("collective")
    (save if args.phase == "save" else restore)(args, hvd.rank(),
                                                hvd.size())


if __name__ == "__main__":
    main()
