"""TF1-style optimizers (`minimize` / `apply_gradients` in
`tf.compat.v1` graph mode) that also train EmbeddingVariables."""

from group_embedding.train.optimizer import AdagradOptimizer
from group_embedding.train.optimizer import AdamOptimizer
from group_embedding.train.optimizer import FtrlOptimizer
from group_embedding.train.optimizer import GradientDescentOptimizer

__all__ = ["AdagradOptimizer", "AdamOptimizer", "FtrlOptimizer",
           "GradientDescentOptimizer"]
