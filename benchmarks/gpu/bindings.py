"""The core's framework-neutral bindings for the GPU scripts of this folder.

The GPU machine has no TensorFlow, so the `group_embedding` package cannot
be imported there: `ops/cuda_core.py` is loaded by path, and through it
the other bindings (`ops/ev_table_core.py`).
"""

import importlib.util
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "_ge_cuda_core", os.path.join(_REPO, "ops", "cuda_core.py"))
cc = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
if not hasattr(cc, "Core"):
    _spec.loader.exec_module(cc)
et = cc.load_sibling("ev_table_core.py")
