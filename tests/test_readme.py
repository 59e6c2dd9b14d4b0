"""The README's quickstart runs as printed and agrees with stock TF.

The quickstart is run twice from the same seed: as printed, and with
`ge` replaced by stock functions (per-table `tf.nn.embedding_lookup_sparse`
and `keras.optimizers.Adagrad`), so that its lookups, loss, gradients and
the optimizer step are all compared with stock TF.
"""

import os
import re
import types

import keras
import numpy as np
import tensorflow as tf

from testing import stock_lookup

_README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
_IMPORT = "import group_embedding as ge\n"


def _quickstart():
    with open(_README) as f:
        text = f.read()
    return re.search(r"## Quickstart\n\n```python\n(.*?)```", text,
                     re.S).group(1)


def _stock_group_lookup(params, sp_ids, combiners, sp_weights=None):
    """Stock stand-in for `ge.group_embedding_lookup_sparse`: one stock
    lookup per table, trailing empty rows padded with zeros."""
    if sp_weights is None:
        sp_weights = [None] * len(params)
    out = []
    for table, ids, weights, combiner in zip(params, sp_ids, sp_weights,
                                             combiners):
        batch = (ids.nrows() if isinstance(ids, tf.RaggedTensor)
                 else ids.dense_shape[0])
        out.append(stock_lookup(table, ids, weights, combiner, batch))
    return out


def _run(code, stock):
    tf.random.set_seed(0)  # the same initial tables in both runs
    scope = {}
    if stock:
        assert _IMPORT in code
        code = code.replace(_IMPORT, "")
        scope["ge"] = types.SimpleNamespace(
            group_embedding_lookup_sparse=_stock_group_lookup,
            optimizers=types.SimpleNamespace(
                Adagrad=keras.optimizers.Adagrad))
    exec(compile(code, "README quickstart", "exec"), scope)
    return scope


def test_quickstart_runs_and_matches_stock():
    code = _quickstart()
    ours = _run(code, stock=False)
    ref = _run(code, stock=True)
    # Outputs before the step, the loss, then every table after one
    # Adagrad step (the row-level updates of IndexedSlices gradients).
    for name in ("u", "i", "t", "loss"):
        np.testing.assert_allclose(ours[name].numpy(), ref[name].numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    for name in ("user_table", "item_table", "tag_table"):
        got, want = ours[name].numpy(), ref[name].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    # The step moved the rows with a gradient, only those (user 9 is in
    # row 2, which has no items: u * i is zero there, so no gradient).
    initial = _run(code.split("opt.apply_gradients")[0], stock=True)
    for name, touched in (("user_table", [7, 2]),
                          ("item_table", [4, 11, 3])):
        before = initial[name].numpy()
        after = ours[name].numpy()
        moved = np.flatnonzero(np.any(after != before, axis=1))
        assert sorted(moved) == sorted(touched), (name, moved)
    # Row 2 has no items: zeros, not NaN.
    np.testing.assert_array_equal(ours["i"].numpy()[2], np.zeros(16))
