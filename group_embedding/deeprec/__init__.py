"""The DeepRec compatibility layer: DeepRec's names, checkpoints and
stand-ins on top of the core (which never imports it).

`name_table` is the table `import group_embedding.compat` installs into
`tf` (install / uninstall); what it installs is defined here beside it:
`stock_lookups` (`ge.embedding_lookup` and the other stock reads, also
accepting an EmbeddingVariable), `feature_column_adapters` (the
stock-signature `embedding_column`, `shared_embedding_columns` and
`input_layer` that route through group_embedding_column_scope),
`runtime_features` (stand-ins for DeepRec-only names, modules and
ConfigProto fields), and `checkpoint` (`ge.restore_deeprec_checkpoint`
and the Saver that reads DeepRec / Deepray checkpoints).

Importing this package installs nothing: only `name_table` does (and it is
imported only by `group_embedding.compat`).
"""
