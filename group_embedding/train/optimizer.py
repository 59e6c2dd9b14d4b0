"""TF1-style optimizers (`tf.compat.v1.train`) that also train
EmbeddingVariables, for graph-mode `minimize` / `apply_gradients`.

Each class subclasses the stock TF1 optimizer: plain variables take the
stock update (sparse resource ops), every `EmbeddingVariable` one C++ op
that updates only its gradient's keys and their slots. The step recorded
as each key's version is `global_step` (the argument of `apply_gradients`,
else `tf.compat.v1.train.get_global_step()`, else 0).
"""

import tensorflow as tf

from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.ops import ev_storage

_v1 = tf.compat.v1


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
                           if isinstance(v, EmbeddingVariable)
                           and v.trainable])
        var_list = list(var_list)
        if not any(isinstance(v, EmbeddingVariable) for v in var_list):
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
               if isinstance(v, EmbeddingVariable) and g is not None]
        rest = [(g, v) for g, v in pairs
                if not isinstance(v, EmbeddingVariable)]
        if all(g is None for g, _ in rest):
            rest = []  # stock TF1 would raise "No gradients provided"
        if not evs:
            return super().apply_gradients(rest, global_step, name)
        step = global_step
        if step is None:
            step = _v1.train.get_global_step()
        step = tf.constant(0, tf.int64) if step is None else \
            tf.cast(tf.convert_to_tensor(step), tf.int64)
        ev_ops = []
        with tf.name_scope(name or self.get_name()):
            for g, v in evs:
                if not isinstance(g, tf.IndexedSlices):
                    raise TypeError(
                        f"{type(self).__name__}: the gradient of "
                        f"EmbeddingVariable '{v.name}' must be IndexedSlices "
                        f"keyed by key, got {type(g).__name__}.")
                ensure = [v.ensure_slot(n, i) for n, i in self._ev_slots()]
                with tf.control_dependencies(
                        [e for e in ensure if e is not None]):
                    ev_ops.append(self._ev_apply(g, v, step))
        with tf.control_dependencies(ev_ops):
            if rest:
                return super().apply_gradients(rest, global_step, name)
            done = self._ev_finish(ev_ops)
            with tf.control_dependencies(done):
                if global_step is None:
                    return tf.group(*done)
                return _v1.assign_add(global_step, 1)

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
        return ev_storage.apply_sgd(ev.handle, grad.indices, grad.values,
                                    step, self._ev_learning_rate())


class AdagradOptimizer(_EVOptimizerMixin, _v1.train.AdagradOptimizer):
    """`tf.compat.v1.train.AdagradOptimizer` + EVs: `accum += g^2; var -=
    lr * g / sqrt(accum)` on the touched keys."""

    def _ev_slots(self):
        return [("adagrad/accumulator", self._initial_accumulator_value)]

    def _ev_apply(self, grad, ev, step):
        return ev_storage.apply_adagrad(ev.handle, grad.indices, grad.values,
                                        step, self._ev_learning_rate(), 0.0,
                                        "adagrad/accumulator")


class AdamOptimizer(_EVOptimizerMixin, _v1.train.AdamOptimizer):
    """`tf.compat.v1.train.AdamOptimizer` + lazy Adam on EVs (only the
    touched keys' m and v change), sharing its beta-power accumulators."""

    def _ev_slots(self):
        return [("adam/m", 0.0), ("adam/v", 0.0)]

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
        lr = self._ev_learning_rate()
        alpha = lr * tf.sqrt(1 - b2p) / (1 - b1p)
        return ev_storage.apply_adam(
            ev.handle, grad.indices, grad.values, step, alpha,
            self._call_if_callable(self._beta1),
            self._call_if_callable(self._beta2),
            self._call_if_callable(self._epsilon), ["adam/m", "adam/v"])

    def _ev_finish(self, ev_ops):
        b1p, b2p = self._get_beta_accumulators()
        with tf.control_dependencies(ev_ops):
            return [b1p.assign(b1p * self._call_if_callable(self._beta1)),
                    b2p.assign(b2p * self._call_if_callable(self._beta2))]


class FtrlOptimizer(_EVOptimizerMixin, _v1.train.FtrlOptimizer):
    """`tf.compat.v1.train.FtrlOptimizer` + EVs (TF's ApplyFtrlV2 on the
    touched keys)."""

    def _ev_slots(self):
        return [("ftrl/accumulator", self._initial_accumulator_value),
                ("ftrl/linear", 0.0)]

    def _ev_apply(self, grad, ev, step):
        lr = self._ev_learning_rate()
        l2 = self._l2_regularization_strength
        if self._beta is not None:
            l2 = l2 + self._beta / (2.0 * lr)
        return ev_storage.apply_ftrl(
            ev.handle, grad.indices, grad.values, step, lr,
            self._l1_regularization_strength, l2,
            self._l2_shrinkage_regularization_strength,
            self._learning_rate_power, ["ftrl/accumulator", "ftrl/linear"])
