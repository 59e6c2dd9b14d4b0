"""Python side of the peer exchange kernel (`kernels/peer_exchange_ops.cc`).

`peer_all_to_all` sends block p of its rows to worker p and receives one
block from each, over connections that `group_embedding.distributed.
transport` opened (socket fds, plus shared-memory regions for workers on
the same host). Every worker must run its exchanges in the same order:
within a graph each exchange made here, its gradient's included, runs
after the previous one (control dependencies), so a graph runs them in
program order. The gradient sends the rows' gradients back to the
workers they came from, in an exchange of its own.

Every function here needs the C++ kernels (`library()` is not None).
"""

import weakref
from typing import Callable
from typing import List

import tensorflow as tf

from group_embedding.ops import capabilities
from group_embedding.ops import op_names

# The op's registered name; the kernel module exposes it as the snake_case
# function TF generates from it (`_function_name`).
OP_NAME = capabilities.PEER_EXCHANGE_OP
# Mixed into the forward tag to tag the gradient's exchange.
_GRADIENT_TAG_MASK = 0x5A5A5A5A
# Per graph, the last exchange created: the next one runs after it.
_last_in_graph: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _function_name(op_name: str) -> str:
    """The Python function name TF generates for `op_name`: a `_` before
    an upper-case letter that follows a lower-case one or precedes one
    ("GroupEmbeddingPeerAllToAll" -> "group_embedding_peer_all_to_all")."""
    out: List[str] = []
    for i, c in enumerate(op_name):
        if c.isupper() and i > 0 and out[-1] != "_" and (
                op_name[i - 1].islower() or (
                    i + 1 < len(op_name) and op_name[i + 1].islower())):
            out.append("_")
        out.append(c.lower())
    return "".join(out)


def library():
    """The kernel module when it holds the exchange op, else None.

    None under `GROUP_EMBEDDING_KERNELS=tf`, when the kernels cannot be
    built, or with a kernel library built before the op existed.
    """
    found = capabilities.current()
    return found.kernels if found.peer_exchange else None


def _in_program_order(build: Callable):
    graph = tf.compat.v1.get_default_graph()
    previous = None if tf.executing_eagerly() else _last_in_graph.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = build()
    if not tf.executing_eagerly():
        _last_in_graph[graph] = out[0].op
    return out


def peer_all_to_all(data: tf.Tensor, splits: tf.Tensor, fds: tf.Tensor,
                    shm: tf.Tensor, expected: tf.Tensor, *, tag: int,
                    timeout_seconds: float = 600.0,
                    max_bytes_per_peer: int = 4 << 30,
                    derived_bytes_per_row: int = 0):
    """Sends block p of `data` (rows `splits[p]`) to worker p.

    Args:
        data: `[n, ...]` rows grouped by destination (float32/64,
            int32/64).
        splits: int32 `[N]`, rows for each worker; sums to n.
        fds: int64 `[N]`, the socket of each worker, -1 for this one.
        shm: int64 `[N, 2]`, per worker (memfd or -1, bytes per buffer).
        expected: int64 `[N]`, the rows each worker must send here, -1
            where any count is accepted.
        tag: names the exchange, the same on every worker; a peer that
            runs another exchange is an error.
        timeout_seconds: an exchange with no byte from a peer for this
            long fails (default 600, the op's).
        max_bytes_per_peer: the most bytes a peer may make this worker
            allocate where `expected` is -1 (default 4 GiB, the op's):
            each row received counts with `derived_bytes_per_row`.
        derived_bytes_per_row: bytes this worker will allocate for each
            row it receives here once the exchange is done (e.g. the
            embedding rows an id turns into), counted against
            `max_bytes_per_peer` before anything is allocated (default 0).

    Returns:
        (received rows by source worker, int32 `[N]` rows from each).
        Differentiable in `data`: the gradient goes back to the senders.
    """
    op = getattr(library(), _function_name(OP_NAME))
    return _in_program_order(lambda: op(
        data, splits, fds, shm, expected, tag=tag,
        timeout_seconds=timeout_seconds,
        max_bytes_per_peer=max_bytes_per_peer,
        derived_bytes_per_row=derived_bytes_per_row))


# For the op and its pre-rename alias PeerAllToAll.
@op_names.register_gradient(OP_NAME)
def _peer_all_to_all_grad(op, grad, _):
    # Rows came from worker p in block p: send their gradients back. Each
    # peer sends back exactly the rows this worker sent it (an exact count:
    # no derived bytes to bound).
    back, _ = peer_all_to_all(
        grad, op.outputs[1], op.inputs[2], op.inputs[3],
        tf.cast(op.inputs[1], tf.int64),
        tag=(op.get_attr("tag") ^ _GRADIENT_TAG_MASK) + 1,
        timeout_seconds=op.get_attr("timeout_seconds"),
        max_bytes_per_peer=op.get_attr("max_bytes_per_peer"))
    return back, None, None, None, None
