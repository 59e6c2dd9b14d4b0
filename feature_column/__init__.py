"""DeepRec-style feature columns (`group_embedding.feature_column`).

Columns, `group_embedding_column_scope` and `input_layer` land here with the
feature-column issue; the package exists now so the layout is final.
"""

__all__ = []
