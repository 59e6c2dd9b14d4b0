"""`import group_embedding.compat`: DeepRec's names on stock TensorFlow.

The public entry point of DeepRec scripts, kept at this path: the name
table and `install()` / `uninstall()` / `is_installed()` live in
group_embedding/deeprec/name_table.py, which installs on import. This
alias makes `group_embedding.compat` that very module (the same object in
`sys.modules`), so its state and functions are the name table's whichever
path imported it first.
"""

import sys

from group_embedding.deeprec import name_table

sys.modules[__name__] = name_table
