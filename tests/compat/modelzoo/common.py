"""What the three model zoo scripts share: DeepRec's flags, the Criteo CSV
(DeepRec's layout), the input pipeline, the EV feature columns and the
MonitoredTrainingSession train / evaluate loop.

The scripts (`dlrm_script.py`, `deepfm_script.py`, `dcnv2_script.py`)
follow DeepRec's `modelzoo/{dlrm,deepfm}/train.py` and
`modelzoo/features/group_embedding/dcnv2/train.py`: the same TF1 / DeepRec
API calls and flag names, smaller networks so that a run takes seconds on
2 cores. `--tf` (alias `--stock`) is DeepRec's baseline switch: stock
hash-bucket embedding columns and `tf.train.AdamOptimizer`, and then
`group_embedding` is never imported.

Data: `python common.py --data_location DIR --rows N` writes
`DIR/train.csv` and `DIR/eval.csv` (no header; label, I1..I13, C1..C26 as
in Criteo; from `tutorials/data.py`, multi-hot cells kept as one token).
"""

import argparse
import collections
import json
import math
import os
import sys

CONTINUOUS_COLUMNS = ["I%d" % i for i in range(1, 14)]
CATEGORICAL_COLUMNS = ["C%d" % i for i in range(1, 27)]
LABEL_COLUMN = "clicked"
TRAIN_DATA_COLUMNS = [LABEL_COLUMN] + CONTINUOUS_COLUMNS + CATEGORICAL_COLUMNS
FEATURE_COLUMNS = CONTINUOUS_COLUMNS + CATEGORICAL_COLUMNS

_HERE = os.path.dirname(os.path.abspath(__file__))
_TUTORIALS = os.path.join(_HERE, os.pardir, os.pardir, os.pardir,
                          "tutorials")


def boolean_string(text):
    """DeepRec's `True` / `False` flag values."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError("not a boolean: %r" % text)
    return text.lower() == "true"


def get_arg_parser(optimizer="adamasync", learning_rate=0.01, steps=0,
                   optimizers=("adam", "adamasync", "adagraddecay",
                               "adagrad", "gradientdescent")):
    """DeepRec's model zoo flags (the embedding and training ones), with
    DeepRec's defaults unless an argument says otherwise.

    Flags of DeepRec runtime features stock TF lacks (`--smartstaged`,
    `--op_fusion`, `--micro_batch`, `--workqueue`, `--parquet_dataset`,
    `--bf16`, `--adaptive_emb`, `--dynamic_ev`, `--incremental_ckpt`) are
    left out.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_location", default="./data")
    parser.add_argument("--steps", type=int, default=steps,
                        help="0: one epoch")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--output_dir", default="./result")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--seed", type=int, default=2021)
    parser.add_argument("--optimizer", choices=list(optimizers),
                        default=optimizer)
    parser.add_argument("--learning_rate", type=float,
                        default=learning_rate)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--keep_checkpoint_max", type=int, default=1)
    parser.add_argument("--inter", type=int, default=0)
    parser.add_argument("--intra", type=int, default=0)
    parser.add_argument("--input_layer_partitioner", type=int, default=8,
                        help="slice size of the input layer, MB")
    parser.add_argument("--dense_layer_partitioner", type=int, default=16,
                        help="slice size of dense layers, KB")
    parser.add_argument("--tf", "--stock", dest="tf", action="store_true",
                        help="stock TF baseline: no DeepRec feature")
    parser.add_argument("--stock_l2_evict", type=float, default=None,
                        help="with --tf: DeepRec's L2WeightEvict rule "
                             "applied to the stock tables at the final "
                             "save (the oracle of --ev_elimination l2)")
    parser.add_argument("--emb_fusion", type=boolean_string, default=True)
    parser.add_argument("--ev", type=boolean_string, default=False)
    parser.add_argument("--ev_elimination", choices=[None, "l2", "gstep"],
                        default=None)
    parser.add_argument("--ev_filter", choices=[None, "counter", "cbf"],
                        default=None)
    # DeepRec's value, 2**30 keys, sizes a counting Bloom filter of about
    # 10**10 counters per column: 82 GB of uint64 (DeepRec callocs it and
    # relies on untouched pages staying virtual). Tests pass a smaller one.
    parser.add_argument("--cbf_max_element_size", type=int, default=2 ** 30)
    parser.add_argument("--group_embedding",
                        choices=[None, "localized", "collective"],
                        default=None)
    return parser


def set_env_for_deeprec(args, tf):
    """DeepRec's `set_env_for_DeepRec`: the collective strategy must be
    enabled before any table is created."""
    if args.group_embedding == "collective":
        tf.config.experimental.enable_distributed_strategy(
            strategy="collective")


def import_tf(args):
    """`tensorflow.compat.v1` in graph mode, with DeepRec's names installed
    unless `--tf` (the stock baseline imports nothing of ours)."""
    # tf.layers (Keras 2) needs tf-keras: see README "Keras 2 scripts".
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow.compat.v1 as tf
    tf.disable_v2_behavior()
    if not args.tf:
        import group_embedding.compat  # noqa: F401  the one added line
    tf.logging.set_verbosity(tf.logging.ERROR)
    return tf


def build_model_input(tf, filename, batch_size, num_epochs, seed):
    """DeepRec's CSV pipeline: shuffle, repeat, batch, `decode_csv`."""

    def parse_csv(value):
        cont_defaults = [[0.0] for _ in CONTINUOUS_COLUMNS]
        cate_defaults = [[" "] for _ in CATEGORICAL_COLUMNS]
        record_defaults = [[0]] + cont_defaults + cate_defaults
        columns = tf.io.decode_csv(value, record_defaults=record_defaults)
        all_columns = collections.OrderedDict(
            zip(TRAIN_DATA_COLUMNS, columns))
        labels = all_columns.pop(LABEL_COLUMN)
        return all_columns, labels

    dataset = tf.data.TextLineDataset(filename)
    dataset = dataset.shuffle(buffer_size=20000, seed=seed)
    dataset = dataset.repeat(num_epochs)
    dataset = dataset.batch(batch_size)
    dataset = dataset.map(parse_csv, num_parallel_calls=2)
    return dataset.prefetch(2)


def ev_option(tf, args):
    """DeepRec's EV options from `--ev_elimination` and `--ev_filter`."""
    if args.ev_elimination == "gstep":
        evict_opt = tf.GlobalStepEvict(steps_to_live=4000)
    elif args.ev_elimination == "l2":
        evict_opt = tf.L2WeightEvict(l2_weight_threshold=1.0)
    else:
        evict_opt = None
    if args.ev_filter == "cbf":
        # counter_type=tf.int64 as in the model zoo (DeepRec counts in
        # uint64 for any type other than the unsigned ones).
        filter_option = tf.CBFFilter(
            filter_freq=3, max_element_size=args.cbf_max_element_size,
            false_positive_probability=0.01, counter_type=tf.int64)
    elif args.ev_filter == "counter":
        filter_option = tf.CounterFilter(filter_freq=3)
    else:
        filter_option = None
    return tf.EmbeddingVariableOption(evict_option=evict_opt,
                                      filter_option=filter_option)


def _categorical_embedding(tf, args, column_name, dimension):
    categorical_column = (
        tf.feature_column.categorical_column_with_hash_bucket(
            column_name, hash_bucket_size=10000, dtype=tf.string))
    if not args.tf:
        ev_opt = ev_option(tf, args)
        if args.ev:
            categorical_column = (
                tf.feature_column.categorical_column_with_embedding(
                    column_name, dtype=tf.string, ev_option=ev_opt))
    if args.tf or not args.emb_fusion:
        return tf.feature_column.embedding_column(
            categorical_column, dimension=dimension, combiner="mean")
    return tf.feature_column.embedding_column(
        categorical_column, dimension=dimension, combiner="mean",
        do_fusion=args.emb_fusion)


def build_feature_columns(tf, args, dimension=16):
    """DeepRec's `build_feature_columns` of DLRM / DeepFM.

    Returns:
        (numeric columns, embedding columns); the embedding columns are
        built inside one `group_embedding_column_scope` when
        `--group_embedding` is set (and not `--tf`).
    """
    dense_column, sparse_column = [], []

    def build():
        for column_name in FEATURE_COLUMNS:
            if column_name in CATEGORICAL_COLUMNS:
                sparse_column.append(_categorical_embedding(
                    tf, args, column_name, dimension))
            else:
                dense_column.append(tf.feature_column.numeric_column(
                    column_name, shape=(1,)))

    if args.group_embedding and not args.tf:
        with tf.feature_column.group_embedding_column_scope(
                name="categorical"):
            build()
    else:
        build()
    return dense_column, sparse_column


def partitioners(tf, args):
    """The model zoo's partitioners: `min_max_variable_partitioner` with
    `max_partitions` = number of parameter servers (0 here: one shard)."""
    num_ps_replicas = 0
    input_layer = tf.min_max_variable_partitioner(
        max_partitions=num_ps_replicas,
        min_slice_size=args.input_layer_partitioner << 20) \
        if args.input_layer_partitioner else None
    dense_layer = tf.min_max_variable_partitioner(
        max_partitions=num_ps_replicas,
        min_slice_size=args.dense_layer_partitioner << 10) \
        if args.dense_layer_partitioner else None
    return input_layer, dense_layer


def data_sizes(args):
    """(train file, eval file, train steps, epochs, eval steps) as DeepRec
    computes them from `--data_location`, `--steps`, `--batch_size`."""
    train_file = os.path.join(args.data_location, "train.csv")
    test_file = os.path.join(args.data_location, "eval.csv")
    for path in (train_file, test_file):
        if not os.path.exists(path):
            sys.exit("Dataset does not exist: %s" % path)
    with open(train_file) as f:
        train_rows = sum(1 for _ in f)
    with open(test_file) as f:
        test_rows = sum(1 for _ in f)
    if args.steps == 0:
        epochs = 1
        steps = math.ceil(train_rows / args.batch_size)
    else:
        epochs = math.ceil(args.batch_size * args.steps / train_rows)
        steps = args.steps
    return (train_file, test_file, steps, epochs,
            math.ceil(test_rows / args.batch_size))


def iterator_for(tf, args):
    """DeepRec's reinitializable iterator over the train and eval sets.

    Returns:
        (next_element, train_init_op, test_init_op, train_steps,
        test_steps).
    """
    train_file, test_file, steps, epochs, test_steps = data_sizes(args)
    train_dataset = build_model_input(tf, train_file, args.batch_size,
                                      epochs, args.seed)
    test_dataset = build_model_input(tf, test_file, args.batch_size, 1,
                                     args.seed)
    iterator = tf.data.Iterator.from_structure(
        tf.data.get_output_types(train_dataset),
        tf.data.get_output_shapes(test_dataset))
    return (iterator.get_next(), iterator.make_initializer(train_dataset),
            iterator.make_initializer(test_dataset), steps, test_steps)


def create_optimizer(tf, args, global_step, adagrad_accumulator=0.1):
    """DeepRec's `_create_optimizer` choice: Adam for `--tf`, else the
    `--optimizer` flag."""
    lr = args.learning_rate
    if args.tf or args.optimizer == "adam":
        return tf.train.AdamOptimizer(learning_rate=lr, beta1=0.9,
                                      beta2=0.999, epsilon=1e-8)
    if args.optimizer == "adamasync":
        return tf.train.AdamAsyncOptimizer(learning_rate=lr, beta1=0.9,
                                           beta2=0.999, epsilon=1e-8)
    if args.optimizer == "adagraddecay":
        return tf.train.AdagradDecayOptimizer(learning_rate=lr,
                                              global_step=global_step)
    if args.optimizer == "adagrad":
        return tf.train.AdagradOptimizer(
            learning_rate=lr, initial_accumulator_value=adagrad_accumulator)
    return tf.train.GradientDescentOptimizer(learning_rate=lr)


def train(tf, args, sess_config, loss, train_op, global_step, data_init_op,
          steps, checkpoint_dir, hooks=()):
    """DeepRec's `train`: MonitoredTrainingSession to `steps`, one
    checkpoint at the end. Returns the losses of the first and last tenth
    of the steps, the number of steps, and the EVs' keys at the last step
    (None for stock)."""
    scaffold = tf.train.Scaffold(
        local_init_op=tf.group(tf.local_variables_initializer(),
                               data_init_op),
        saver=tf.train.Saver(max_to_keep=args.keep_checkpoint_max))
    hooks = list(hooks) + [tf.train.StopAtStepHook(last_step=steps)]
    rows_op = embedding_rows(tf)
    counter = None
    if rows_op is not None:
        counter = _rows_at_last_step_hook(tf, rows_op, steps)
        hooks.append(counter)
    if args.tf and args.stock_l2_evict is not None:
        hooks.append(stock_l2_eviction_hook(
            tf, args.stock_l2_evict, scaffold.saver, global_step,
            checkpoint_dir))
    losses = []
    with tf.train.MonitoredTrainingSession(
            master="", is_chief=True, hooks=hooks, scaffold=scaffold,
            checkpoint_dir=checkpoint_dir,
            save_checkpoint_steps=args.save_steps or steps,
            summary_dir=checkpoint_dir,
            save_summaries_steps=args.save_steps,
            log_step_count_steps=None, config=sess_config) as sess:
        while not sess.should_stop():
            losses.append(float(sess.run([loss, train_op])[0]))
    tenth = max(1, len(losses) // 10)
    return (sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth,
            len(losses), None if counter is None else counter.rows)


def stock_l2_eviction_hook(tf, threshold, saver, global_step,
                           checkpoint_dir):
    """DeepRec's `L2WeightEvict(threshold)` on stock tables, at the final
    save as DeepRec evicts when it saves: every embedding row with
    0.5 * sum(v^2) < threshold is zeroed (an evicted EV key reads zeros,
    the no-permission default, when it comes back under a filter), and
    the final checkpoint is written again."""
    tables = [v for v in tf.global_variables()
              if ("embedding_weights" in v.name or "_weight" in v.name)
              and v.shape.rank == 2 and "/Adam" not in v.name]
    assert tables, "no embedding tables found"
    evict = tf.group([
        v.assign(v * tf.cast(0.5 * tf.reduce_sum(
            tf.square(v), axis=1, keepdims=True) >= threshold, v.dtype))
        for v in tables])

    class StockL2Evict(tf.train.SessionRunHook):
        # MonitoredTrainingSession's saver hook runs first and has saved
        # the final step; the same checkpoint is overwritten.
        def end(self, session):
            session.run(evict)
            saver.save(session, os.path.join(checkpoint_dir, "model.ckpt"),
                       global_step=session.run(global_step))

    return StockL2Evict()


def embedding_rows(tf):
    """An op counting the keys stored in this worker's EVs, or None
    without EVs (the stock baseline). A run whose embeddings all read zero
    (nothing admitted, everything evicted) has none."""
    evs = [v for v in tf.get_collection(tf.GraphKeys.SAVEABLE_OBJECTS)
           if type(v).__name__ == "EmbeddingVariable"]
    if not evs:
        return None
    return tf.add_n([tf.cast(ev.size(), tf.int64) for ev in evs])


def _rows_at_last_step_hook(tf, rows_op, steps):
    """A hook that fetches `rows_op` with the last training step, i.e.
    before the final save, which runs the eviction policy; it keeps the
    value in `.rows`. (A factory: `tf` is imported by the script.)"""

    class RowsAtLastStep(tf.train.SessionRunHook):
        def __init__(self):
            self.runs, self.rows = 0, None

        def before_run(self, run_context):
            self.runs += 1
            if self.runs == steps:
                return tf.train.SessionRunArgs(rows_op)
            return None

        def after_run(self, run_context, run_values):
            if self.runs == steps:
                self.rows = int(run_values.results)

    return RowsAtLastStep()


def evaluate(tf, sess_config, auc_op, data_init_op, steps, checkpoint_dir):
    """DeepRec's `eval`: restores the checkpoint into a fresh session and
    runs the streaming AUC over the eval set. Returns the AUC and the
    restored tables' `embedding_rows`."""
    rows_op = embedding_rows(tf)
    scaffold = tf.train.Scaffold(local_init_op=tf.group(
        tf.local_variables_initializer(), data_init_op))
    creator = tf.train.ChiefSessionCreator(
        scaffold=scaffold, checkpoint_dir=checkpoint_dir, config=sess_config)
    value, rows = float("nan"), None
    with tf.train.MonitoredSession(session_creator=creator) as sess:
        if rows_op is not None:
            rows = int(sess.run(rows_op))
        for _ in range(steps):
            value = float(sess.run(auc_op))
    return value, rows


def session_config(tf, args):
    """DeepRec's session config (no DeepRec-only graph options)."""
    config = tf.ConfigProto()
    config.inter_op_parallelism_threads = args.inter
    config.intra_op_parallelism_threads = args.intra
    return config


def report(args, model, evaluation, training, optimizer=None):
    """Prints the one JSON line the test reads; `evaluation` and
    `training` are what `evaluate` and `train` return."""
    auc, rows = evaluation
    first_loss, last_loss, steps, trained_rows = training
    print(json.dumps({
        "model": model, "auc": auc, "embedding_rows": rows,
        "trained_rows": trained_rows, "first_loss": first_loss,
        "last_loss": last_loss, "steps": steps, "stock": bool(args.tf),
        "ev": args.ev, "ev_filter": args.ev_filter,
        "ev_elimination": args.ev_elimination,
        "group_embedding": args.group_embedding,
        "optimizer": optimizer or ("adam" if args.tf else args.optimizer)}))


def write_criteo_csv(directory, rows=30000, eval_fraction=0.2, seed=0,
                     vocab_cap=2000):
    """Writes `directory/train.csv` and `directory/eval.csv` in DeepRec's
    Criteo layout from `tutorials/data.py`'s generator.

    Returns:
        The number of training rows.
    """
    sys.path.insert(0, _TUTORIALS)
    import data  # tutorials/data.py
    frame, _ = data.generate(rows, vocab_cap=vocab_cap, seed=seed)
    frame = frame.rename(columns={"label": LABEL_COLUMN})
    frame = frame[TRAIN_DATA_COLUMNS]
    cut = int(rows * (1 - eval_fraction))
    os.makedirs(directory, exist_ok=True)
    frame[:cut].to_csv(os.path.join(directory, "train.csv"), header=False,
                       index=False)
    frame[cut:].to_csv(os.path.join(directory, "eval.csv"), header=False,
                       index=False)
    return cut


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="writes the CSVs")
    _parser.add_argument("--data_location", required=True)
    _parser.add_argument("--rows", type=int, default=30000)
    _parser.add_argument("--seed", type=int, default=0)
    _args = _parser.parse_args()
    print(write_criteo_csv(_args.data_location, _args.rows,
                           seed=_args.seed))
