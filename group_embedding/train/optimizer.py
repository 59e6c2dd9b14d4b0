"""TF1-style optimizers (`tf.compat.v1.train`) that also train
EmbeddingVariables, for graph-mode `minimize` / `apply_gradients`.

Each class subclasses the stock TF1 optimizer: plain variables take the
stock update (sparse resource ops), every `EmbeddingVariable` one C++ op
that updates only its gradient's keys and their slots. The step recorded
as each key's version is `global_step` (the argument of `apply_gradients`,
else `tf.compat.v1.train.get_global_step()`, else 0).
"""

import tensorflow as tf
import tensorflow.compat.v1 as _v1

from group_embedding.embedding_variable.variable import EV_INIT_SLOT_OPS
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.ops import backward_apply
from group_embedding.ops import sparse_apply


class _EVOptimizerMixin:
    """Splits EV gradients from the stock TF1 path."""

    def _ev_slots(self):
        return []

    def _ev_apply(self, grad, ev, step):
        raise NotImplementedError

    def _ev_finish(self, ev_ops):
        """Optimizer state updated once per step when no plain variable
        is trained (the stock `_finish` does it otherwise)."""
        return ev_ops

    def compute_gradients(self, loss, var_list=None,
                          gate_gradients=_v1.train.Optimizer.GATE_OP,
                          aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        if var_list is None:
            var_list = (_v1.trainable_variables()
                        + [v for v in _v1.get_collection(
                            _v1.GraphKeys.SAVEABLE_OBJECTS)
                           if is_embedding_variable(v)
                           and v.trainable])
        var_list = list(var_list)
        if not any(is_embedding_variable(v) for v in var_list):
            return super().compute_gradients(
                loss, var_list, gate_gradients, aggregation_method,
                colocate_gradients_with_ops, grad_loss)
        if callable(loss):
            raise NotImplementedError(
                f"{type(self).__name__}: a callable `loss` is not supported "
                "with EmbeddingVariables; pass a tensor.")
        # tf.gradients takes EVs like resource variables (via `.handle`).
        grads = _v1.gradients(
            loss, var_list,
            grad_ys=None if grad_loss is None else [grad_loss],
            gate_gradients=gate_gradients == _v1.train.Optimizer.GATE_OP,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops)
        return list(zip(grads, var_list))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = list(grads_and_vars)
        evs = [(g, v) for g, v in pairs
               if is_embedding_variable(v) and g is not None]
        rest = [(g, v) for g, v in pairs
                if not is_embedding_variable(v)]
        if all(g is None for g, _ in rest):
            rest = []  # stock TF1 would raise "No gradients provided"
        rest, fused = self._fuse_plain(rest)
        if fused and all(g is None for g, _ in rest):
            rest = []
        if not evs and not fused:
            return super().apply_gradients(rest, global_step, name)
        step = global_step
        if step is None:
            step = _v1.train.get_global_step()
        step = tf.constant(0, tf.int64) if step is None else \
            tf.cast(tf.convert_to_tensor(step), tf.int64)
        ev_ops = list(fused)
        with tf.name_scope(name or self.get_name()):
            ensured = {}
            for g, v in evs:
                if not isinstance(g, tf.IndexedSlices):
                    raise TypeError(
                        f"{type(self).__name__}: the gradient of "
                        f"EmbeddingVariable '{v.name}' must be IndexedSlices "
                        f"keyed by key, got {type(g).__name__}.")
                # A slot's index is its registration order (the checkpoint
                # and the export list slots by it); a session runs ops with
                # no edge between them in any order, so chain them.
                ensure = []
                for n, i in self._ev_slots():
                    with tf.control_dependencies(
                            [e for e in ensure[-1:] if e is not None]):
                        ensure.append(v.ensure_slot(n, i))
                for op in ensure:
                    if op is not None:  # graph mode: DeepRec's collection
                        _v1.add_to_collection(EV_INIT_SLOT_OPS, op)
                ensured[id(v)] = [e for e in ensure if e is not None]
            with tf.control_dependencies(
                    [e for ops in ensured.values() for e in ops]):
                evs, fused_evs = self._fuse_ev(evs, step)
            ev_ops.extend(fused_evs)
            for g, v in evs:
                with tf.control_dependencies(ensured[id(v)]):
                    ev_ops.append(self._ev_apply(g, v, step))
        with tf.control_dependencies(ev_ops):
            if rest:
                return super().apply_gradients(rest, global_step, name)
            done = self._ev_finish(ev_ops)
            with tf.control_dependencies(done):
                if global_step is None:
                    return tf.group(*done)
                return _v1.assign_add(global_step, 1)

    def _fused_rule(self):
        """How sparse updates map onto a fused backward-apply
        (ops/backward_apply.py: plain tables on the GPU kernels, pooled
        EV groups on the CPU kernels), or None. Called once the slots
        exist."""
        return None

    def _fuse_plain(self, pairs):
        """Applies the lookup groups the GPU kernels can fuse (backward
        and update in one op per group); returns (pairs left, fused ops).
        """
        candidates = [(g, v) for g, v in pairs
                      if isinstance(g, tf.IndexedSlices)]
        if tf.executing_eagerly() or not candidates:
            return pairs, []
        rule = self._fused_rule()
        if rule is None:
            return pairs, []
        left, fused = backward_apply.fuse(candidates, rule)
        done = {id(v) for _, v in candidates} - {id(v) for _, v in left}
        return [(g, v) for g, v in pairs if id(v) not in done], fused

    def _fuse_ev(self, pairs, step):
        """Applies the pooled EV lookup groups of `pairs` in one op per
        group, backward and update together (`backward_apply.fuse_ev`);
        returns (pairs left for `_ev_apply`, fused ops)."""
        if tf.executing_eagerly() or not pairs:
            return pairs, []
        rule = self._fused_rule()
        if rule is None:
            return pairs, []
        return backward_apply.fuse_ev(pairs, rule._replace(
            ev_slots=[n for n, _ in self._ev_slots()], step=step))

    def _made_slot(self, var, name):
        """Slot `name` of plain variable `var` for a fused update, made
        now (the stock apply makes slots later; get-or-make, it finds
        them made). Only fused groups make them early."""
        with tf.init_scope():
            self._create_slots([var])
        return self.get_slot(var, name)

    def _ev_learning_rate(self):
        # Stock TF1 Adam calls it `_lr`, the others `_learning_rate`.
        lr = getattr(self, "_learning_rate", None)
        if lr is None:
            lr = self._lr
        return tf.cast(self._call_if_callable(lr), tf.float32)


class GradientDescentOptimizer(_EVOptimizerMixin,
                               _v1.train.GradientDescentOptimizer):
    """`tf.compat.v1.train.GradientDescentOptimizer` + EVs: `var -= lr *
    g` on the touched keys."""

    def _ev_apply(self, grad, ev, step):
        return ev.storage.apply_sgd(ev.handle, grad.indices, grad.values,
                                    step, self._ev_learning_rate())

    def _fused_rule(self):
        return backward_apply.Rule(
            "sgd", lambda v: [],
            backward_apply.hyper(lr=self._ev_learning_rate()))


class AdagradOptimizer(_EVOptimizerMixin, _v1.train.AdagradOptimizer):
    """`tf.compat.v1.train.AdagradOptimizer` + EVs: `accum += g^2; var -=
    lr * g / sqrt(accum)` on the touched keys."""

    def _ev_slots(self):
        return [("adagrad/accumulator", self._initial_accumulator_value)]

    # Plain resource variables: the C++ update (one pass over the rows,
    # duplicates summed inside) instead of stock's ResourceSparseApply-
    # Adagrad, ~10x slower on the 26 criteo-like tables. Epsilon 0: TF1
    # Adagrad has none (accum starts at initial_accumulator_value > 0).
    def _resource_apply_sparse_duplicate_indices(self, grad, handle,
                                                 indices):
        if sparse_apply.has_fused_adagrad(handle):
            return self._fused_adagrad(grad, handle, indices)
        return super()._resource_apply_sparse_duplicate_indices(
            grad, handle, indices)

    def _resource_apply_sparse(self, grad, var, indices):
        if sparse_apply.has_fused_adagrad(var):
            return self._fused_adagrad(grad, var, indices)
        return super()._resource_apply_sparse(grad, var, indices)

    def _fused_adagrad(self, grad, var, indices):
        lr = tf.cast(self._learning_rate_tensor, grad.dtype)
        return sparse_apply.adagrad(var, self.get_slot(var, "accumulator"),
                                    lr, 0.0, indices, grad)

    def _ev_apply(self, grad, ev, step):
        return ev.storage.apply_adagrad(ev.handle, grad.indices, grad.values,
                                        step, self._ev_learning_rate(), 0.0,
                                        "adagrad/accumulator")

    def _fused_rule(self):
        return backward_apply.Rule(
            "adagrad", lambda v: [self._made_slot(v, "accumulator")],
            backward_apply.hyper(lr=self._ev_learning_rate()))


class AdamOptimizer(_EVOptimizerMixin, _v1.train.AdamOptimizer):
    """`tf.compat.v1.train.AdamOptimizer` + lazy Adam on EVs (only the
    touched keys' m and v change), sharing its beta-power accumulators."""

    def _ev_slots(self):
        return [("adam/m", 0.0), ("adam/v", 0.0)]

    def _create_non_slot_variable(self, initial_value, name, colocate_with):
        # `AdamOptimizer(lr, global_step)` (DeepRec's tests) starts a beta
        # power from a variable. Reading it directly races with its own
        # initializer inside global_variables_initializer() (stock TF then
        # fails at random with FailedPrecondition); read its initial value
        # until it is initialized.
        if isinstance(initial_value, tf.Variable) \
                and not tf.executing_eagerly():
            source = initial_value
            initial_value = tf.cond(
                _v1.is_variable_initialized(source), source.read_value,
                lambda: tf.convert_to_tensor(source.initial_value))
        return super()._create_non_slot_variable(initial_value, name,
                                                 colocate_with)

    def _powers(self, ev):
        with tf.init_scope():
            for name, beta in (("beta1_power", self._beta1),
                               ("beta2_power", self._beta2)):
                self._create_non_slot_variable(
                    initial_value=beta, name=name,
                    colocate_with=ev.default_values)
        return self._get_beta_accumulators()

    def _ev_apply(self, grad, ev, step):
        b1p, b2p = self._powers(ev)
        # Stock Adam casts its powers and constants to the variable's
        # dtype: `AdamOptimizer(lr, <int64 tensor>)` gives int64 powers.
        b1p, b2p = tf.cast(b1p, tf.float32), tf.cast(b2p, tf.float32)
        lr = self._ev_learning_rate()
        alpha = lr * tf.sqrt(1 - b2p) / (1 - b1p)
        return ev.storage.apply_adam(
            ev.handle, grad.indices, grad.values, step, alpha,
            self._call_if_callable(self._beta1),
            self._call_if_callable(self._beta2),
            self._call_if_callable(self._epsilon), ["adam/m", "adam/v"])

    def _ev_finish(self, ev_ops):
        b1p, b2p = self._get_beta_accumulators()
        beta1, beta2 = (tf.cast(self._call_if_callable(b), p.dtype.base_dtype)
                        for b, p in ((self._beta1, b1p), (self._beta2, b2p)))
        with tf.control_dependencies(ev_ops):
            return [b1p.assign(b1p * beta1), b2p.assign(b2p * beta2)]


class FtrlOptimizer(_EVOptimizerMixin, _v1.train.FtrlOptimizer):
    """`tf.compat.v1.train.FtrlOptimizer` + EVs (TF's ApplyFtrlV2 on the
    touched keys)."""

    def _ev_slots(self):
        return [("ftrl/accumulator", self._initial_accumulator_value),
                ("ftrl/linear", 0.0)]

    def _l2(self, lr):
        l2 = self._l2_regularization_strength
        if self._beta is not None:
            l2 = l2 + self._beta / (2.0 * lr)
        return l2

    def _fused_rule(self):
        lr = self._ev_learning_rate()
        return backward_apply.Rule(
            "ftrl",
            lambda v: [self._made_slot(v, "accum"),
                       self._made_slot(v, "linear")],
            backward_apply.hyper(
                lr=lr, l1=self._l1_regularization_strength, l2=self._l2(lr),
                l2_shrinkage=self._l2_shrinkage_regularization_strength,
                lr_power=self._learning_rate_power))

    def _ev_apply(self, grad, ev, step):
        lr = self._ev_learning_rate()
        l2 = self._l2(lr)
        return ev.storage.apply_ftrl(
            ev.handle, grad.indices, grad.values, step, lr,
            self._l1_regularization_strength, l2,
            self._l2_shrinkage_regularization_strength,
            self._learning_rate_power, ["ftrl/accumulator", "ftrl/linear"])


class AdamAsyncOptimizer(_EVOptimizerMixin, _v1.train.Optimizer):
    """DeepRec's `tf.train.AdamAsyncOptimizer`: Adam whose beta powers are
    kept per variable (slots `beta1_power`, `beta2_power`, starting at
    beta1 / beta2) and advanced by each apply to that variable.

    Per apply, with `alpha = lr * sqrt(1 - beta2_power) / (1 -
    beta1_power)`: `m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2)
    g^2; var -= alpha m / (sqrt(v) + epsilon)`, then `beta1_power *=
    beta1; beta2_power *= beta2`. Dense gradients update every row (the
    same numbers as stock `AdamOptimizer` when each variable is updated
    every step); sparse gradients and EVs update only the touched rows.

    With `apply_sparse_rmsprop=True`, sparse updates of plain variables
    are `v = beta2 v + (1 - beta2) g^2; m = beta1 m + lr g / sqrt(v +
    epsilon); var -= m` (beta powers unchanged), as in DeepRec.

    Args:
        learning_rate: float or tensor, default 0.001.
        beta1, beta2, epsilon: Adam's constants (0.9, 0.999, 1e-8).
        use_locking: as stock.
        apply_sparse_rmsprop: see above (default False).
        name: default "AdamAsync".

    Raises:
        NotImplementedError: (at apply) `apply_sparse_rmsprop=True` with an
            EmbeddingVariable.
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999,
                 epsilon=1e-8, use_locking=False, apply_sparse_rmsprop=False,
                 name="AdamAsync"):
        super().__init__(use_locking, name)
        self._lr = learning_rate
        self._beta1 = beta1
        self._beta2 = beta2
        self._epsilon = epsilon
        self._apply_sparse_rmsprop = apply_sparse_rmsprop
        self._ev_powers = {}

    def _constants(self, dtype):
        c = self._call_if_callable
        return [tf.cast(c(x), dtype) for x in
                (self._lr, self._beta1, self._beta2, self._epsilon)]

    def _create_slots(self, var_list):
        for v in var_list:
            self._zeros_slot(v, "m", self._name)
            self._zeros_slot(v, "v", self._name)
            for slot, beta in (("beta1_power", self._beta1),
                               ("beta2_power", self._beta2)):
                self._get_or_make_slot(
                    v, tf.constant(self._call_if_callable(beta),
                                   v.dtype.base_dtype), slot, self._name)

    def _advance_powers(self, var, deps):
        beta1, beta2 = self._constants(var.dtype.base_dtype)[1:3]
        b1p = self.get_slot(var, "beta1_power")
        b2p = self.get_slot(var, "beta2_power")
        with tf.control_dependencies(deps):
            return tf.group(b1p.assign(b1p * beta1), b2p.assign(b2p * beta2))

    def _resource_apply_dense(self, grad, var):
        lr, beta1, beta2, eps = self._constants(var.dtype.base_dtype)
        update = tf.raw_ops.ResourceApplyAdam(
            var=var.handle, m=self.get_slot(var, "m").handle,
            v=self.get_slot(var, "v").handle,
            beta1_power=self.get_slot(var, "beta1_power"),
            beta2_power=self.get_slot(var, "beta2_power"), lr=lr,
            beta1=beta1, beta2=beta2, epsilon=eps, grad=grad,
            use_locking=self._use_locking)
        return self._advance_powers(var, [update])

    def _apply_dense(self, grad, var):
        # Reference variables (`tf.compat.v1.disable_v2_behavior()`, as
        # DeepRec's TF1 scripts run): the ref kernel of the same update.
        lr, beta1, beta2, eps = self._constants(var.dtype.base_dtype)
        update = tf.raw_ops.ApplyAdam(
            var=var, m=self.get_slot(var, "m"), v=self.get_slot(var, "v"),
            beta1_power=self.get_slot(var, "beta1_power").read_value(),
            beta2_power=self.get_slot(var, "beta2_power").read_value(),
            lr=lr, beta1=beta1, beta2=beta2, epsilon=eps, grad=grad,
            use_locking=self._use_locking)
        return self._advance_powers(var, [update])

    def _apply_sparse(self, grad, var):
        # Reference variables; `grad` is IndexedSlices, duplicates summed.
        return self._resource_apply_sparse(grad.values, var, grad.indices)

    def _resource_apply_sparse(self, grad, var, indices):
        # The base class has summed duplicate indices already.
        lr, beta1, beta2, eps = self._constants(var.dtype.base_dtype)
        m_slot, v_slot = self.get_slot(var, "m"), self.get_slot(var, "v")
        m = tf.gather(m_slot, indices)
        v = beta2 * tf.gather(v_slot, indices) + (1 - beta2) * grad * grad
        if self._apply_sparse_rmsprop:
            m = beta1 * m + lr * grad / tf.sqrt(v + eps)
            step = m
        else:
            b1p = self.get_slot(var, "beta1_power")
            b2p = self.get_slot(var, "beta2_power")
            alpha = lr * tf.sqrt(1 - b2p) / (1 - b1p)
            m = beta1 * m + (1 - beta1) * grad
            step = alpha * m / (tf.sqrt(v) + eps)
        updates = [m_slot.scatter_update(tf.IndexedSlices(m, indices)),
                   v_slot.scatter_update(tf.IndexedSlices(v, indices)),
                   var.scatter_sub(tf.IndexedSlices(step, indices))]
        if self._apply_sparse_rmsprop:
            return tf.group(*updates)
        return self._advance_powers(var, updates)

    def _ev_slots(self):
        return [("adam_async/m", 0.0), ("adam_async/v", 0.0)]

    def _ev_apply(self, grad, ev, step):
        if self._apply_sparse_rmsprop:
            raise NotImplementedError(
                f"AdamAsyncOptimizer: `apply_sparse_rmsprop=True` is not "
                f"supported for EmbeddingVariable '{ev.name}'; use "
                "apply_sparse_rmsprop=False (Adam) on EVs.")
        if ev.name not in self._ev_powers:
            with tf.init_scope():
                self._ev_powers[ev.name] = [
                    tf.Variable(float(self._call_if_callable(b)),
                                trainable=False, dtype=tf.float32,
                                name=f"{ev.name}/{self._name}/{n}")
                    for n, b in (("beta1_power", self._beta1),
                                 ("beta2_power", self._beta2))]
        b1p, b2p = self._ev_powers[ev.name]
        lr, beta1, beta2, eps = self._constants(tf.float32)
        alpha = lr * tf.sqrt(1 - b2p) / (1 - b1p)
        update = ev.storage.apply_adam(
            ev.handle, grad.indices, grad.values, step, alpha, beta1, beta2,
            eps, ["adam_async/m", "adam_async/v"])
        deps = [update] if update is not None else []
        with tf.control_dependencies(deps):
            return tf.group(b1p.assign(b1p * beta1), b2p.assign(b2p * beta2))


class AdagradDecayOptimizer(_EVOptimizerMixin, _v1.train.Optimizer):
    """DeepRec's `tf.train.AdagradDecayOptimizer`: Adagrad whose
    accumulator is decayed once per `accumulator_decay_step` global steps,
    on plain variables and EmbeddingVariables alike.

    With `t = global_step + 1` and per row a decay counter `p` (slot
    `accumulator_decay_power`, starting at 0): when a row is updated and
    `t // accumulator_decay_step > p`, first `accum = max(accum *
    accumulator_decay_rate, initial_accumulator_value)` and `p += 1`; then
    `accum += g^2; var -= lr * g / sqrt(accum)`. Dense gradients update
    every row; sparse ones and EVs only the touched rows (on an EV, `p` is
    kept as a float slot, exact up to 2**24 decay periods).

    Args:
        learning_rate: float or tensor.
        global_step: the global step variable (required, as in DeepRec).
        initial_accumulator_value: start and floor of the accumulators,
            > 0 (default 0.1).
        accumulator_decay_step: period in steps, > 0 (default 100000).
        accumulator_decay_rate: factor in (0, 1) (default 0.9).
        use_locking: as stock.
        name: default "AdagradDecay".

    Raises:
        ValueError: an argument out of its range.
    """

    def __init__(self, learning_rate, global_step,
                 initial_accumulator_value=0.1,
                 accumulator_decay_step=100000, accumulator_decay_rate=0.9,
                 use_locking=False, name="AdagradDecay"):
        if initial_accumulator_value <= 0.0:
            raise ValueError("AdagradDecayOptimizer: "
                             "`initial_accumulator_value` must be > 0, got "
                             f"{initial_accumulator_value}.")
        if accumulator_decay_step <= 0:
            raise ValueError("AdagradDecayOptimizer: "
                             "`accumulator_decay_step` must be > 0, got "
                             f"{accumulator_decay_step}.")
        if not 0.0 < accumulator_decay_rate < 1.0:
            raise ValueError("AdagradDecayOptimizer: "
                             "`accumulator_decay_rate` must be in (0, 1), "
                             f"got {accumulator_decay_rate}.")
        if global_step is None:
            raise ValueError("AdagradDecayOptimizer: `global_step` is "
                             "required (the decay period counts it).")
        super().__init__(use_locking, name)
        self._learning_rate = learning_rate
        self._global_step = global_step
        self._initial_accumulator_value = initial_accumulator_value
        self._decay_step = accumulator_decay_step
        self._decay_rate = accumulator_decay_rate

    def _create_slots(self, var_list):
        for v in var_list:
            init = tf.compat.v1.constant_initializer(
                self._initial_accumulator_value, dtype=v.dtype.base_dtype)
            self._get_or_make_slot_with_initializer(
                v, init, v.shape, v.dtype.base_dtype, "accumulator",
                self._name)
            rows = tf.TensorShape(v.shape[:1])
            self._get_or_make_slot_with_initializer(
                v, tf.compat.v1.zeros_initializer(tf.int64), rows, tf.int64,
                "accumulator_decay_power", self._name)

    def _update_rows(self, var, grad, indices):
        """The rule on rows `indices` (None: all rows) with their grads."""
        dtype = var.dtype.base_dtype
        acc_slot = self.get_slot(var, "accumulator")
        power_slot = self.get_slot(var, "accumulator_decay_power")
        t = tf.cast(self._global_step, tf.int64) + 1
        period = t // tf.cast(self._decay_step, tf.int64)
        if indices is None:
            acc, power = acc_slot.read_value(), power_slot.read_value()
        else:
            acc = tf.gather(acc_slot, indices)
            power = tf.gather(power_slot, indices)
        decay = period > power
        mask = tf.reshape(decay, tf.concat(
            [tf.shape(decay), tf.ones([tf.rank(acc) - 1], tf.int32)], 0))
        decayed = tf.maximum(acc * tf.cast(self._decay_rate, dtype),
                             tf.cast(self._initial_accumulator_value, dtype))
        acc = tf.where(mask, decayed, acc) + grad * grad
        power = power + tf.cast(decay, tf.int64)
        step = tf.cast(self._call_if_callable(self._learning_rate),
                       dtype) * grad / tf.sqrt(acc)
        if indices is None:
            return tf.group(acc_slot.assign(acc), power_slot.assign(power),
                            var.assign_sub(step))
        return tf.group(
            acc_slot.scatter_update(tf.IndexedSlices(acc, indices)),
            power_slot.scatter_update(tf.IndexedSlices(power, indices)),
            var.scatter_sub(tf.IndexedSlices(step, indices)))

    def _resource_apply_dense(self, grad, var):
        return self._update_rows(var, grad, None)

    def _resource_apply_sparse(self, grad, var, indices):
        # The base class has summed duplicate indices already.
        return self._update_rows(var, grad, indices)

    # Reference variables (`tf.compat.v1.disable_v2_behavior()`): the same
    # rule, their assign / scatter methods are the resource ones' names.
    def _apply_dense(self, grad, var):
        return self._update_rows(var, grad, None)

    def _apply_sparse(self, grad, var):
        return self._update_rows(var, grad.values, grad.indices)

    def _ev_slots(self):
        return [("adagrad_decay/accumulator",
                 self._initial_accumulator_value),
                ("adagrad_decay/accumulator_decay_power", 0.0)]

    def _ev_apply(self, grad, ev, step):
        # The rule of `_update_rows`, per key, in one storage op.
        t = tf.cast(self._global_step, tf.int64) + 1
        period = t // tf.cast(self._decay_step, tf.int64)
        return ev.storage.apply_adagrad_decay(
            ev.handle, grad.indices, grad.values, step,
            self._ev_learning_rate(), self._decay_rate,
            self._initial_accumulator_value, period,
            ["adagrad_decay/accumulator",
             "adagrad_decay/accumulator_decay_power"])
