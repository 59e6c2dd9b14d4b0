"""Keras-style optimizers with fast sparse (IndexedSlices) updates.

`ge.optimizers.Adagrad` updates only the rows a batch touched, with one
multithreaded C++ op per variable (duplicates summed first), and behaves
like `keras.optimizers.Adagrad` on dense gradients.
"""

from group_embedding.optimizers.adagrad import Adagrad

__all__ = ["Adagrad"]
