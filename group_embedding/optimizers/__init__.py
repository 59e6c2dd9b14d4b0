"""Keras-style optimizers with fast sparse (IndexedSlices) updates that
also train `EmbeddingVariable`s.

Each updates only the rows a batch touched (duplicates summed first) and
takes the stock Keras update on dense gradients, so one optimizer trains a
whole model. `ge.optimizers.Adagrad` runs one multithreaded C++ op per
plain variable; EVs are always updated by one C++ op each.
"""

from group_embedding.optimizers.adagrad import Adagrad
from group_embedding.optimizers.adam import Adam
from group_embedding.optimizers.ftrl import Ftrl
from group_embedding.optimizers.sgd import SGD

__all__ = ["Adagrad", "Adam", "Ftrl", "SGD"]
