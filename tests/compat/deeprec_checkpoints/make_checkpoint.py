"""Test data for ge.restore_deeprec_checkpoint: trains a 2-feature model on Deepray
EmbeddingVariables (deepray 0.21.89, TF 2.15) for 3 steps on fixed ids, writes a
tf.train.Checkpoint, then trains 2 more steps (CONTINUATION) and writes the expected contents of
every key after step 3 and after step 5, and Deepray's losses, as JSON.

A modified copy of ../shared/peers/deepray/make_checkpoint.py (the peer's script that wrote the
shipped checkpoint); what changed:
  * --optimizer adagrad|adam|ftrl (deepray.optimizers.Adagrad / Adam / FtrlOptimizer); the numpy
    model has Deepray's lazy Adam (bias-corrected step size, t = step + 1) and TF's FTRL;
  * --partitions P: each feature is P EVs named <feature>/part_k holding the keys k with
    key mod P == k (DeepRec's "mod" partitioned EV). Deepray cannot create a partitioned EV
    (get_embedding_variable(partitioner=...) fails: '_VariableStore' object has no attribute
    '_get_partitioned_variable'), so the parts are made by hand; the checkpoint's names are the
    ones a partitioned EV's parts get;
  * 2 more steps after the save (CONTINUATION, each key at most once per step so that Deepray's
    per-step freq count equals an occurrence count); their losses and the state after them
    are in expected.json under "continuation";
  * --deeprec-names: also writes OUT_DIR/deeprec/model.*, the same tensors renamed as DeepRec
    (TF 1.15) names them: no ':0', slot EVs <ev>/<Optimizer>, <ev>/<Optimizer>_1 (slot_creator's
    unique names in slot-creation order), the global step as "global_step" (with Adam also
    TF1 Adam's "beta1_power", "beta2_power" = beta^(global_step + 1)).

Model: features "user_ev" (CounterFilter(filter_freq), default 2) and "item_ev" (no filter),
dim --dim, initial rows from a fixed table via InitializerOption(default_value_dim=N): key k
starts at init_table[k % N]. Per feature tf.nn.embedding_lookup_sparse(EV, combiner='sum'),
concat, loss = mean(out**2), deepray.optimizers.Adagrad (acc += g^2; w -= lr*g/sqrt(acc), no
epsilon), TF_RECORD_FREQ=1 and TF_RECORD_VERSION=1 so that every EV records freqs and versions.

The expected values come from an independent numpy model of Deepray's semantics (below) and are
asserted against (a) the live EVs, (b) the checkpoint's tensors and (c) a restore of the
checkpoint into fresh EVs; the script exits non-zero on any mismatch. Semantics modelled
(observed on deepray 0.21.89 CPU kernels):
  * lookup: a stored admitted key gives its row; a key an unfiltered EV has not stored gives
    init_table[k % N]; a key a CounterFilter EV has not admitted gives zeros;
  * apply (once per unique key per step, KvResourceSparseApplyAdagrad[WithCounts]):
    freq += count, version = global step (0-based step index); with a CounterFilter the key is
    admitted once freq >= filter_freq, and on the step it is admitted its row starts at
    init_table[k % N], accumulator at --init-acc, and it already gets that step's update;
    not-admitted keys get no row/accumulator update;
  * count = 1 per step a key occurs in, NOT its number of occurrences: embedding_lookup_sparse
    gathers unique ids, so the gradient's IndexedSlices (which the optimizer counts) has each
    key once. (DeepRec passes occurrence counts; Deepray on this path does not. With
    tf.nn.embedding_lookup(EV, ids) the gradient keeps duplicates and freq counts occurrences.)

Run in the Deepray venv that ../shared/peers/deepray/setup.sh makes:
  DIR/venv/bin/python make_checkpoint.py OUT_DIR [--optimizer adam] [--partitions 2]
writes OUT_DIR/model.{index,data-00000-of-00001} and OUT_DIR/expected.json; prints the
checkpoint's tensor names and shapes (tf.train.list_variables) last.

Checkpoint layout (tensor names are the EV's *variable name including ':0'*, then a suffix):
  <ev>:0-keys [n] int64, -values [n, dim], -freqs [n], -versions [n]          admitted keys
  <ev>:0-keys_filtered, -freqs_filtered, -versions_filtered                      filtered-out keys
  <ev>:0-partition_offset [1001], -partition_filter_offset [1001]               per hash partition
  Adagrad/<ev>/accumulator:0-<same suffixes>                                     Adagrad slot EV
  plus the object graph, opt/iter etc. and dummy scalar 2.0 tensors "<obj>/value"
  (Deepray's registered saver writes placeholders for every EV object; the first one is dropped).
"""
import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_RECORD_FREQ"] = "1"      # read by each EV when it is created
os.environ["TF_RECORD_VERSION"] = "1"

import numpy as np  # noqa: E402

# step -> feature -> rows (ragged ids). Keys 9 and 1 share default row 1 (9 % 8).
BATCHES = [
    {"user_ev": [[1, 2], [3], [1, 1]], "item_ev": [[10], [11, 12], [10]]},
    {"user_ev": [[1, 4], [2], [5, 9]], "item_ev": [[10, 13], [11], [14, 14]]},
    {"user_ev": [[1], [2, 6], [4]], "item_ev": [[12], [10], [15, 11]]},
]
# After the save. Keys 3 and 5 (seen once before the save) are seen once more at step 3, so a
# CounterFilter(2) admits them there and step 4 reads their updated rows; 9 and the new key 7
# are admitted at step 4. Each key occurs at most once per step (see the docstring).
CONTINUATION = [
    {"user_ev": [[3], [5, 1], [7]], "item_ev": [[10, 16], [11], [12]]},
    {"user_ev": [[3, 9], [5], [7, 2]], "item_ev": [[16], [13, 10], [14]]},
]
FEATURES = ["user_ev", "item_ev"]  # EV names must not end in '0' (TF rstrip(":0") bug)
SLOTS = {"adagrad": ["accumulator"], "adam": ["m", "v"], "ftrl": ["accumulator", "linear"]}
OPT_NAMES = {"adagrad": "Adagrad", "adam": "Adam", "ftrl": "Ftrl"}


def init_table(n, dim):
    """Deterministic initial rows: init[r, d] = 0.1 * (r + 1) + 0.01 * d (float32)."""
    return (0.1 * (np.arange(n)[:, None] + 1) + 0.01 * np.arange(dim)[None, :]).astype(np.float32)


def slot_inits(args):
    return {"adagrad": {"accumulator": args.init_acc}, "adam": {"m": 0.0, "v": 0.0},
            "ftrl": {"accumulator": args.init_acc, "linear": 0.0}}[args.optimizer]


def apply_rule(args, e, gk, step):
    """One optimizer update of an admitted key's row and slots (float32)."""
    f32 = np.float32
    lr = f32(args.lr)
    if args.optimizer == "adagrad":
        e["slots"]["accumulator"] = e["slots"]["accumulator"] + gk * gk
        e["row"] = e["row"] - lr * gk / np.sqrt(e["slots"]["accumulator"])
    elif args.optimizer == "adam":   # Deepray/DeepRec lazy Adam, t = step + 1
        b1, b2, eps = f32(args.beta1), f32(args.beta2), f32(args.epsilon)
        t = step + 1
        alpha = lr * np.sqrt(f32(1) - b2 ** t) / (f32(1) - b1 ** t)
        m = e["slots"]["m"] = b1 * e["slots"]["m"] + (f32(1) - b1) * gk
        v = e["slots"]["v"] = b2 * e["slots"]["v"] + (f32(1) - b2) * gk * gk
        e["row"] = e["row"] - alpha * m / (np.sqrt(v) + eps)
    else:                            # TF's FTRL, lr_power -0.5, l1 = l2 = 0
        acc, lin = e["slots"]["accumulator"], e["slots"]["linear"]
        new_acc = acc + gk * gk
        lin = lin + gk - (np.sqrt(new_acc) - np.sqrt(acc)) / lr * e["row"]
        quad = np.sqrt(new_acc) / lr
        e["row"] = (-lin / quad).astype(f32)
        e["slots"]["accumulator"], e["slots"]["linear"] = new_acc, lin


def numpy_model(args, batches):
    """Independent model of the Deepray step; returns (losses, state after each step)."""
    dim, f32 = args.dim, np.float32
    init = init_table(args.default_value_dim, dim)
    filt = {"user_ev": args.filter_freq, "item_ev": 0}
    st = {f: {} for f in FEATURES}  # key -> dict(row, slots, freq, version, admitted)
    losses, states = [], []
    for step, batch in enumerate(batches):
        pooled = []
        for f in FEATURES:
            out = np.zeros((len(batch[f]), dim), f32)
            for b, ids in enumerate(batch[f]):
                for k in ids:
                    e = st[f].get(k)
                    if filt[f]:
                        v = e["row"] if e and e["admitted"] else np.zeros(dim, f32)
                    else:
                        v = e["row"] if e else init[k % args.default_value_dim]
                    out[b] += v
            pooled.append(out)
        cat = np.concatenate(pooled, axis=1)
        losses.append(float(np.mean(np.square(cat, dtype=np.float64))))
        gcat = (f32(2.0) / f32(cat.size)) * cat
        for fi, f in enumerate(FEATURES):
            gout = gcat[:, fi * dim:(fi + 1) * dim]
            g = {}
            for b, ids in enumerate(batch[f]):
                for k in ids:
                    g[k] = g.get(k, np.zeros(dim, f32)) + gout[b]
            for k, gk in g.items():
                e = st[f].setdefault(k, {"row": None, "slots": None, "freq": 0, "version": -1,
                                         "admitted": False})
                e["freq"] += 1            # one count per step (unique ids), see docstring
                if args.optimizer != "ftrl":   # Deepray's KvResourceSparseApplyFtrl takes
                    e["version"] = step          # no global step: versions stay -1
                if not e["admitted"] and e["freq"] >= max(filt[f], 1):
                    e["admitted"] = True
                    e["row"] = init[k % args.default_value_dim].copy()
                    e["slots"] = {n: np.full(dim, v, f32) for n, v in slot_inits(args).items()}
                if e["admitted"]:
                    apply_rule(args, e, gk, step)
        states.append(json.loads(json.dumps(state_json(st))))
    return losses, states, st


def state_json(st):
    return {f: {str(k): {"admitted": e["admitted"],
                         "row": None if e["row"] is None else [float(x) for x in e["row"]],
                         "slots": None if e["slots"] is None else
                         {n: [float(x) for x in v] for n, v in e["slots"].items()},
                         "freq": e["freq"], "version": e["version"]}
                for k, e in sorted(st[f].items())} for f in FEATURES}


def ev_names(args):
    """feature -> names of its EVs (one, or the parts of a partitioned one)."""
    if not args.partitions:
        return {f: [f] for f in FEATURES}
    return {f: [f"{f}/part_{p}" for p in range(args.partitions)] for f in FEATURES}


def part_of(args, k):
    return k % args.partitions if args.partitions else 0


def build(tf, args, ev_variables, get_embedding_variable):
    from deepray.optimizers.adagrad import Adagrad
    from deepray.optimizers.adam import Adam
    from deepray.optimizers.ftrl import FtrlOptimizer
    if args.optimizer == "adagrad":   # before the EVs: sets --ev_slot_num
        opt = Adagrad(learning_rate=args.lr, initial_accumulator_value=args.init_acc)
    elif args.optimizer == "adam":
        opt = Adam(learning_rate=args.lr, beta_1=args.beta1, beta_2=args.beta2,
                   epsilon=args.epsilon)
    else:
        opt = FtrlOptimizer(learning_rate=args.lr, initial_accumulator_value=args.init_acc)
    opt.global_step = opt.iterations
    init = init_table(args.default_value_dim, args.dim)
    evs = {}
    for f, names in ev_names(args).items():
        for n in names:
            filt = ev_variables.CounterFilter(filter_freq=args.filter_freq) if f == "user_ev" else None
            option = ev_variables.EmbeddingVariableOption(
                filter_option=filt,
                init_option=ev_variables.InitializerOption(
                    initializer=lambda shape, dtype=None, partition_info=None: tf.constant(init),
                    default_value_dim=args.default_value_dim))
            evs[n] = get_embedding_variable(n, embedding_dim=args.dim, key_dtype=tf.int64,
                                            value_dtype=tf.float32, ev_option=option)
    # Slots are created on the first apply inside name_scope(opt._name) ("Adagrad/<ev>/accumulator");
    # create them the same way now so that a restore finds them under the same names.
    with tf.name_scope(opt._name):
        opt._create_all_weights(list(evs.values()))
    return opt, evs


def flatten(tf, args, batch):
    """Per EV: the ids of its keys and their row splits."""
    flat = []
    for f, names in ev_names(args).items():
        for p, _ in enumerate(names):
            rows = [[k for k in r if part_of(args, k) == p] for r in batch[f]]
            flat.append(tf.constant([k for r in rows for k in r], tf.int64))
            flat.append(tf.constant(np.concatenate([[0], np.cumsum([len(r) for r in rows])]),
                                    tf.int64))
    return flat


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--optimizer", choices=sorted(SLOTS), default="adagrad")
    p.add_argument("--partitions", type=int, default=0, help="parts per feature (0: none)")
    p.add_argument("--deeprec-names", action="store_true")
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--init-acc", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--epsilon", type=float, default=1e-7)
    p.add_argument("--filter-freq", type=int, default=2, help="CounterFilter on user_ev")
    p.add_argument("--default-value-dim", type=int, default=8)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-7,
                   help="1e-6 for Adam: eps 1e-7 next to sqrt(v) ~ 1e-5 amplifies float32 rounding")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    import tensorflow as tf
    import deepray  # noqa: F401
    from deepray.custom_ops.embedding_variable import variables as ev_variables
    from deepray.custom_ops.embedding_variable.variable_scope import get_embedding_variable
    from deepray.version import __version__ as dp_version

    opt, evs = build(tf, args, ev_variables, get_embedding_variable)
    names_of = ev_names(args)
    order = [n for f in FEATURES for n in names_of[f]]

    @tf.function
    def train(*flat):
        with tf.GradientTape() as tape:
            outs = []
            i = 0
            for f in FEATURES:
                if not args.partitions:
                    sp = tf.RaggedTensor.from_row_splits(flat[i], flat[i + 1]).to_sparse()
                    outs.append(tf.nn.embedding_lookup_sparse(evs[f], sp, None, combiner="sum"))
                    i += 2
                    continue
                pooled = 0.0
                for n in names_of[f]:
                    ids, splits = flat[i], flat[i + 1]
                    i += 2
                    # unique keys in the lookup: the gradient holds each key once, as
                    # embedding_lookup_sparse's (freq +1 per step)
                    uniq, idx = tf.unique(ids)
                    rows = tf.gather(tf.nn.embedding_lookup(evs[n], uniq), idx)
                    seg = tf.ragged.row_splits_to_segment_ids(splits)
                    pooled += tf.math.unsorted_segment_sum(rows, seg, tf.size(splits) - 1)
                outs.append(pooled)
            loss = tf.reduce_mean(tf.square(tf.concat(outs, axis=1)))
        evl = [evs[n] for n in order]
        opt.apply_gradients(zip(tape.gradient(loss, evl), evl))
        return loss

    losses = [float(train(*flatten(tf, args, b))) for b in BATCHES]

    exp_losses, _, st = numpy_model(args, BATCHES)
    bad = []

    def close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.allclose(a, b, rtol=args.rtol, atol=args.atol):
            bad.append(f"{what}: got {a.tolist()} expected {b.tolist()}")

    close(losses, exp_losses, "losses")

    from deepray.custom_ops.embedding_variable import gen_kv_variable_ops as kv_ops

    def check_live(st, when):
        """freq/version of every key, rows and slots of admitted keys, read from the live EVs."""
        for f in FEATURES:
            for k, e in sorted(st[f].items()):
                ev = evs[names_of[f][part_of(args, k)]]
                kk = tf.constant([k], tf.int64)
                close(kv_ops.ev_get_frequency(ev.handle, kk, Tvalues=tf.float32).numpy(),
                      [e["freq"]], f"{when} live {f}[{k}] freq")
                close(kv_ops.ev_get_version(ev.handle, kk, Tvalues=tf.float32).numpy(),
                      [e["version"]], f"{when} live {f}[{k}] version")
                if e["admitted"]:
                    close(ev.sparse_read(kk).numpy()[0], e["row"], f"{when} live {f}[{k}] row")
                    for s in SLOTS[args.optimizer]:
                        close(opt.get_slot(ev, s).sparse_read(kk).numpy()[0], e["slots"][s],
                              f"{when} live {f}[{k}] {s}")

    check_live(st, "saved")
    prefix = tf.train.Checkpoint(**{n.replace("/", "_"): evs[n] for n in order},
                                 optimizer=opt).write(os.path.join(args.out_dir, "model"))
    names = {n: evs[n].name for n in order}
    slot_names = {n: {s: opt.get_slot(evs[n], s).name for s in SLOTS[args.optimizer]}
                  for n in order}

    # (b) checkpoint tensors
    rd = tf.train.load_checkpoint(prefix)

    def t(n):
        return rd.get_tensor(n)

    for f in FEATURES:
        for part, n in enumerate(names_of[f]):
            ev_name = names[n]
            mine = {k: e for k, e in st[f].items() if part_of(args, k) == part}
            keys, filt_keys = t(ev_name + "-keys").tolist(), t(ev_name + "-keys_filtered").tolist()
            exp_adm = sorted(k for k, e in mine.items() if e["admitted"])
            exp_filt = sorted(k for k, e in mine.items() if not e["admitted"])
            if sorted(keys) != exp_adm or sorted(filt_keys) != exp_filt:
                bad.append(f"ckpt {n}: keys {keys} / filtered {filt_keys}, expected {exp_adm} / {exp_filt}")
                continue
            vals, freqs, vers = t(ev_name + "-values"), t(ev_name + "-freqs"), t(ev_name + "-versions")
            for i, k in enumerate(keys):
                close(vals[i], mine[k]["row"], f"ckpt {ev_name}[{k}] row")
                close(freqs[i], mine[k]["freq"], f"ckpt {ev_name}[{k}] freq")
                close(vers[i], mine[k]["version"], f"ckpt {ev_name}[{k}] version")
            for i, k in enumerate(filt_keys):
                close(t(ev_name + "-freqs_filtered")[i], mine[k]["freq"], f"ckpt {ev_name}[{k}] freq (filtered)")
                close(t(ev_name + "-versions_filtered")[i], mine[k]["version"],
                      f"ckpt {ev_name}[{k}] version (filtered)")
            for s, sn in slot_names[n].items():
                skeys, svals = t(sn + "-keys").tolist(), t(sn + "-values")
                if sorted(skeys) != exp_adm:
                    bad.append(f"ckpt {sn}: keys {skeys}, expected {exp_adm}")
                    continue
                for i, k in enumerate(skeys):
                    close(svals[i], mine[k]["slots"][s], f"ckpt {sn}[{k}] {s}")

    tensors = [(n, list(s)) for n, s in tf.train.list_variables(prefix)]

    # (c) continue training the live model (what a restore continues from: the peer's
    # script checked that a restore reads back every row, slot, freq and version)
    cont_losses = [float(train(*flatten(tf, args, b))) for b in CONTINUATION]
    all_losses, states, st_after = numpy_model(args, BATCHES + CONTINUATION)
    close(cont_losses, all_losses[len(BATCHES):], "continuation losses")
    check_live(st_after, "after continuation")

    if args.deeprec_names:
        write_deeprec_names(tf, args, rd, tensors, names, slot_names)

    expected = {
        "what": f"Deepray EV checkpoint after 3 {OPT_NAMES[args.optimizer]} steps"
                + (f", {args.partitions} parts per feature" if args.partitions else "")
                + "; see make_checkpoint.py",
        "command": " ".join(["make_checkpoint.py"] + sys.argv[1:]),
        "versions": {"deepray": dp_version, "tensorflow": tf.__version__, "numpy": np.__version__},
        "checkpoint_prefix": os.path.basename(prefix),
        "config": {"optimizer": args.optimizer, "dim": args.dim, "lr": args.lr,
                   "init_acc": args.init_acc, "adagrad_epsilon": 0.0,
                   "beta1": args.beta1, "beta2": args.beta2, "adam_epsilon": args.epsilon,
                   "ftrl": "lr_power -0.5, l1 = l2 = 0, beta 0",
                   "partitions": args.partitions, "partition_rule": "key mod partitions",
                   "filter_freq": {"user_ev": args.filter_freq, "item_ev": 0},
                   "default_value_dim": args.default_value_dim,
                   "init_table": init_table(args.default_value_dim, args.dim).tolist(),
                   "init_rule": "key k starts at init_table[k % default_value_dim]",
                   "combiner": "sum", "loss": "mean(concat([pooled_user, pooled_item], 1)**2)",
                   "version_rule": "global step (0-based step index) of the key's last apply"
                                   + (" (FTRL: never stamped, -1)" if args.optimizer == "ftrl" else ""),
                   "freq_rule": "+1 per step the key occurs in (not per occurrence)",
                   "env": {"TF_RECORD_FREQ": "1", "TF_RECORD_VERSION": "1"}},
        "batches": BATCHES,
        "losses": exp_losses,
        "losses_deepray": losses,
        "ev_names": names_of,
        "tensor_names": {n: {"ev": names[n], **slot_names[n]} for n in order},
        "keys": state_json(st),
        "checkpoint_tensors": tensors,
        "continuation": {"batches": CONTINUATION,
                         "losses": all_losses[len(BATCHES):],
                         "losses_deepray": cont_losses,
                         "keys": state_json(st_after)},
        "checks": {"live": "ok", "checkpoint": "ok", "continuation": "ok"} if not bad else bad,
    }
    with open(os.path.join(args.out_dir, "expected.json"), "w") as fh:
        json.dump(expected, fh, indent=1)
    for n, s in tensors:
        print(f"{n}\t{s}")
    if bad:
        print("MISMATCH:\n  " + "\n  ".join(bad), file=sys.stderr)
        sys.exit(1)
    print(f"ok: {prefix} + {os.path.join(args.out_dir, 'expected.json')} "
          f"(live EVs, checkpoint tensors and 2 more steps all match the numpy model)")


def write_deeprec_names(tf, args, rd, tensors, names, slot_names):
    """OUT_DIR/deeprec/model: the EV tensors under DeepRec's (TF 1.15) names."""
    rename = {}
    for n, ev_name in names.items():
        # n, not ev_name: Deepray's names lose trailing '0's ("part_0" -> "part_:0")
        rename[ev_name] = n
        for i, sn in enumerate(slot_names[n].values()):
            suffix = "" if i == 0 else f"_{i}"
            rename[sn] = f"{n}/{OPT_NAMES[args.optimizer]}{suffix}"
    out_names, out_tensors = [], []
    for t_name, _ in tensors:
        if "-" not in t_name:
            continue
        var, suffix = t_name.rsplit("-", 1)
        if var in rename:
            out_names.append(f"{rename[var]}-{suffix}")
            out_tensors.append(rd.get_tensor(t_name))
    step = rd.get_tensor("optimizer/iter/.ATTRIBUTES/VARIABLE_VALUE")
    out_names.append("global_step")
    out_tensors.append(step)
    if args.optimizer == "adam":
        # DeepRec's TF1 AdamOptimizer keeps beta^(t+1) for the next step t in two variables;
        # Deepray's Keras Adam derives them from `iterations` instead.
        for name, beta in (("beta1_power", args.beta1), ("beta2_power", args.beta2)):
            out_names.append(name)
            out_tensors.append(np.float32(beta) ** np.float32(step + 1))
    prefix = os.path.join(args.out_dir, "deeprec", "model")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=out_names,
                      shape_and_slices=[""] * len(out_names),
                      tensors=[tf.constant(x) for x in out_tensors])


if __name__ == "__main__":
    main()
