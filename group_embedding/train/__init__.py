"""TF1-style optimizers (`minimize` / `apply_gradients` in
`tf.compat.v1` graph mode) that also train EmbeddingVariables."""

from group_embedding.train.optimizer import AdagradDecayOptimizer
from group_embedding.train.optimizer import AdagradOptimizer
from group_embedding.train.optimizer import AdamAsyncOptimizer
from group_embedding.train.optimizer import AdamOptimizer
from group_embedding.train.optimizer import FtrlOptimizer
from group_embedding.train.optimizer import GradientDescentOptimizer

__all__ = ["AdagradDecayOptimizer", "AdagradOptimizer",
           "AdamAsyncOptimizer", "AdamOptimizer", "FtrlOptimizer",
           "GradientDescentOptimizer"]
