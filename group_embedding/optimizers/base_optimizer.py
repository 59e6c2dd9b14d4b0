"""Routing of EmbeddingVariable gradients inside Keras 3 optimizers.

`BaseOptimizer` is mixed in front of a stock Keras optimizer class: plain
variables go through the stock `apply` (so one optimizer trains a whole
model, dense layers included), while every `EmbeddingVariable` is updated
by one C++ op that touches only its gradient's keys and the slots stored
with them.
"""

import warnings
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import tensorflow as tf

from group_embedding.embedding_variable.keras_variable import (
    embedding_variable_of,
)
from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.ops import backward_apply

# Keras options that the EV update path cannot honour.
_UNSUPPORTED_WITH_EV = ("clipnorm", "clipvalue", "global_clipnorm",
                        "weight_decay", "use_ema", "loss_scale_factor",
                        "gradient_accumulation_steps")


class BaseOptimizer:
    """Mixin: EmbeddingVariable updates + the stock Keras optimizer.

    Subclasses list their per-key slots in `_ev_slots()` and implement
    `_ev_update_step(gradient, variable, learning_rate)`. The step passed
    to the storage (and recorded as each key's version) is
    `self.iterations` before this step's increment.
    """

    # Provided by the Keras optimizer this is mixed into.
    iterations: Any

    def _ev_slots(self) -> List[Tuple[str, float]]:
        """(slot name, initial value) pairs stored with every key."""
        return []

    def _ev_update_step(self, gradient, variable, learning_rate):
        raise NotImplementedError

    def _check_ev_options(self, variable: EmbeddingVariable):
        for option in _UNSUPPORTED_WITH_EV:
            value = getattr(self, option, None)
            if value not in (None, False, 0):
                raise NotImplementedError(
                    f"{type(self).__name__}: `{option}`={value!r} is not "
                    f"supported for EmbeddingVariable '{variable.name}'.")

    def _ensure_ev_slots(self, variable: EmbeddingVariable):
        ensured: Dict[int, EmbeddingVariable] = self.__dict__.setdefault(
            "_ev_ensured", {})
        if id(variable) in ensured:
            return
        # Slots are created once, eagerly (like Keras slot variables),
        # even when the first step is being traced by tf.function.
        with tf.init_scope():
            for name, init in self._ev_slots():
                variable.ensure_slot(name, init)
        ensured[id(variable)] = variable

    @staticmethod
    def _dense_variables(var_list):
        """`var_list` without EVs: their slots live with their keys."""
        return [v for v in var_list if embedding_variable_of(v) is None]

    def build(self, var_list):
        """Builds the stock state for the plain variables of `var_list`.

        EVs (and their `KerasEmbeddingVariable`s) get no Keras slot
        variables, so the optimizer holds the same variables whether
        `model.fit`, `compile_from_config` (in `load_model`) or the first
        `apply` builds it, and a saved optimizer state loads back.
        """
        super().build(self._dense_variables(var_list))

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            return super().apply(grads)
        grads = list(grads)
        variables = list(trainable_variables)
        # EVs come as themselves (custom loops) or, from `model.fit`, as
        # the KerasEmbeddingVariable that stands for them in the layer.
        evs = [embedding_variable_of(v) for v in variables]
        if all(ev is None for ev in evs):
            left = self._apply_fused(list(zip(grads, variables)))
            if len(left) == len(grads):
                return super().apply(grads, variables)
            if any(g is not None for g, _ in left):
                return super().apply([g for g, _ in left],
                                     [v for _, v in left])
            # Every gradient went to the fused ops; the stock apply would
            # return without counting the step.
            self.iterations.assign_add(1)
            return None
        if all(g is None for g in grads):
            # Stock Keras refuses this for any variable; without it an EV
            # would silently stay unchanged while `iterations` advances.
            raise ValueError("No gradients provided for any variable.")
        rest = [(g, v) for g, v, ev in zip(grads, variables, evs)
                if ev is None]
        rest_has_gradients = any(g is not None for g, _ in rest)
        # The stock apply warns about its own variables without gradient.
        missing = [v.name for g, v, ev in zip(grads, variables, evs)
                   if g is None and (ev is not None or not rest_has_gradients)]
        if missing:
            warnings.warn(f"Gradients do not exist for variables {missing} "
                          "when minimizing the loss.")
        lr = self._get_current_learning_rate()
        ev_pairs = []
        for g, ev in zip(grads, evs):
            if ev is None or g is None:
                continue
            self._check_ev_options(ev)
            if not isinstance(g, tf.IndexedSlices):
                raise TypeError(
                    f"{type(self).__name__}: the gradient of "
                    f"EmbeddingVariable '{ev.name}' must be IndexedSlices "
                    f"keyed by key, got {type(g).__name__}.")
            self._ensure_ev_slots(ev)
            ev_pairs.append((g, ev))
        for g, ev in self._apply_fused_ev(ev_pairs, variables):
            self._ev_update_step(g, ev, lr)
        rest = self._apply_fused(rest)
        # The stock apply refuses all-None gradients, but the EVs were
        # updated: then only warn (above), as it does for some Nones.
        if any(g is not None for g, _ in rest):
            return super().apply([g for g, _ in rest], [v for _, v in rest])
        self.iterations.assign_add(1)
        return None

    def _fused_rule(self) -> Optional[backward_apply.Rule]:
        """How this step's sparse updates map onto the core's fused
        backward-apply (ops/backward_apply.py), or None: the optimizer's
        own update for every variable. Called once the optimizer is
        built."""
        return None

    def _apply_fused(self, pairs):
        """Applies the lookup groups the GPU kernels can fuse (backward
        and update in one op per group, ops/backward_apply.py); returns
        the (gradient, variable) pairs left for the per-variable update.

        Not with the Keras options that act on the gradients or the
        variables between the backward and the update (the EV path's
        list), nor for variables with a constraint.
        """
        if (tf.executing_eagerly()
                or not any(isinstance(g, tf.IndexedSlices) for g, _ in pairs)
                or any(getattr(self, o, None) not in (None, False, 0)
                       for o in _UNSUPPORTED_WITH_EV)):
            return pairs
        candidates = [(g, v) for g, v in pairs
                      if isinstance(g, tf.IndexedSlices)
                      and getattr(v, "constraint", None) is None
                      and not getattr(v, "overwrite_with_gradient", False)]
        if not self.built:
            self.build([v for _, v in pairs])
        rule = self._fused_rule()
        if rule is None:
            return pairs
        left = {id(v) for _, v in backward_apply.fuse(candidates, rule)[0]}
        fused = {id(v) for _, v in candidates} - left
        return [(g, v) for g, v in pairs if id(v) not in fused]

    def _apply_fused_ev(self, pairs, variables):
        """Applies the pooled EV lookup groups of `pairs` ((gradient,
        EmbeddingVariable) pairs) in one op per group, backward and
        update together (ops/backward_apply.py, `fuse_ev`); returns the
        pairs left for `_ev_update_step`. `variables`: every variable of
        this apply, to build the optimizer with.
        """
        if tf.executing_eagerly() or not pairs:
            return pairs
        if not self.built:
            self.build(variables)
        rule = self._fused_rule()
        if rule is None:
            return pairs
        rule = rule._replace(ev_slots=[n for n, _ in self._ev_slots()],
                             step=self._ev_step())
        return backward_apply.fuse_ev(pairs, rule)[0]

    def _ev_step(self) -> tf.Tensor:
        return tf.cast(self.iterations, tf.int64)
