"""Build logic of group-embedding; the metadata is in pyproject.toml.

`feature_column/` and `ops/` live at the top of the repository (README.md,
Layout) and are mapped to `group_embedding.feature_column` and
`group_embedding.ops` with `package_dir`.

The C++ kernels are compiled by `build_ext` against the TensorFlow of the
build environment, the way TF custom-op projects do:

* wheel / `pip install .`: into the wheel as
  `group_embedding/ops/_group_embedding_ops*.so` plus its record
  `_group_embedding_ops.json` (TF version, sources digest, sha256),
  portable (`GROUP_EMBEDDING_NATIVE=1` adds `-march=native`);
* `pip install -e .`: into the user cache (see `ops/kernel_library.py`),
  for this CPU; a failure there only warns (the kernels are then compiled
  on first use, e.g. after the C++ sources are fixed).

The kernel sources ship too: a TensorFlow other than the one of the build
gets its library compiled into the user cache on first use.
"""

import importlib
import os
import subprocess
import sys
import types

import setuptools
from setuptools.command.build_ext import build_ext

_HERE = os.path.dirname(os.path.abspath(__file__))
# Top-level folders installed as subpackages of group_embedding.
_MAPPED = ("feature_column", "ops")


def _packages():
    # Discovered, so that a new subpackage cannot be left out of the wheel.
    found = ["group_embedding"] + [
        "group_embedding." + p
        for p in setuptools.find_packages(os.path.join(_HERE,
                                                       "group_embedding"))]
    for top in _MAPPED:
        found += ["group_embedding." + top] + [
            f"group_embedding.{top}.{p}"
            for p in setuptools.find_packages(os.path.join(_HERE, top))]
    return found


def _kernel_library():
    # The package cannot be imported before it is installed (on a fresh
    # machine nothing named group_embedding exists yet), yet
    # ops/kernel_library.py is the one definition of the compiler command
    # and imports its siblings (ops/config.py) by their package names.
    # For the load, `group_embedding` and `group_embedding.ops` are bare
    # module objects whose path is this tree's ops/: no __init__ runs,
    # and only the stdlib-only modules kernel_library names are loaded.
    names = ("group_embedding", "group_embedding.ops")
    saved = {n: sys.modules.pop(n) for n in list(sys.modules)
             if n in names or n.startswith("group_embedding.")}
    package = types.ModuleType("group_embedding")
    package.__path__ = []
    ops = types.ModuleType("group_embedding.ops")
    ops.__path__ = [os.path.join(_HERE, "ops")]
    package.ops = ops
    sys.modules.update({"group_embedding": package,
                        "group_embedding.ops": ops})
    try:
        return importlib.import_module("group_embedding.ops.kernel_library")
    finally:
        for n in [n for n in sys.modules if n in names
                  or n.startswith("group_embedding.")]:
            del sys.modules[n]
        sys.modules.update(saved)


class BuildKernels(build_ext):
    """Compiles the TF op library instead of a CPython extension."""

    def _editable(self):
        return bool(getattr(self, "editable_mode", False) or self.inplace)

    def run(self):
        kernels = _kernel_library()
        if self._editable():
            try:
                path = kernels.build(verbose=bool(self.verbose > 1))
                print(f"group-embedding kernels: {path}")
            except RuntimeError as e:
                # The repository may hold a half-edited kernel; the
                # install still works and the build is retried on use.
                print(f"WARNING: group-embedding kernels not built now "
                      f"({e}); they are compiled on first use.")
            return
        native = os.environ.get("GROUP_EMBEDDING_NATIVE", "0") == "1"
        for ext in self.extensions:
            path = os.path.join(self.build_lib, self.get_ext_filename(
                self.get_ext_fullname(ext.name)))
            record = os.path.join(os.path.dirname(path),
                                  "_group_embedding_ops.json")
            print(f"compiling the group-embedding kernels into {path} "
                  f"(TensorFlow {kernels.tf.__version__})")
            kernels.compile_library(path, record, native=native,
                                    verbose=bool(self.verbose > 1))
        self._build_gpu_kernels()

    def _build_gpu_kernels(self):
        # The GPU library (ops/gpu_kernel_library.py) where TF is a CUDA
        # build and a CUDA compiler is found, into the user cache. Run
        # from the built package (build_py ran before build_ext); an
        # editable install gets it from scripts/setup.sh or on first use.
        env = dict(os.environ, PYTHONPATH=os.path.abspath(self.build_lib),
                   TF_CPP_MIN_LOG_LEVEL="2")
        proc = subprocess.run(
            [sys.executable, "-m", "group_embedding.ops.gpu_kernel_library"],
            env=env, capture_output=True, text=True, check=False)
        print((proc.stdout.strip().splitlines() or [""])[-1] or
              f"GPU kernels not built: {proc.stderr.strip()[-500:]}")

    def get_outputs(self):
        if self._editable():
            return []
        outputs = []
        for ext in self.extensions:
            path = os.path.join(self.build_lib, self.get_ext_filename(
                self.get_ext_fullname(ext.name)))
            outputs += [path, os.path.join(os.path.dirname(path),
                                           "_group_embedding_ops.json")]
        return outputs

    def get_output_mapping(self):
        return {}


setuptools.setup(
    # Listed in pyproject's `dynamic`: a plain license string works with
    # setuptools 64-84 alike (the table / SPDX forms each break one end).
    license="Apache-2.0",
    packages=_packages(),
    package_dir={"group_embedding": "group_embedding",
                 **{"group_embedding." + top: top for top in _MAPPED}},
    # The sources ship for the compile-on-first-use fallback.
    package_data={"group_embedding.ops": ["kernels/*.cc", "kernels/*.h",
                                          "cuda/*.cu", "cuda/*.cuh",
                                          "cuda/*.cc", "cuda/*.h"]},
    exclude_package_data={"group_embedding.ops": ["kernels/*.so",
                                                   "kernels/*.lock"]},
    # No Python sources: BuildKernels compiles ops/kernels/*.cc itself.
    # Declaring it makes the wheel platform-specific, as the .so is.
    ext_modules=[setuptools.Extension(
        "group_embedding.ops._group_embedding_ops", sources=[])],
    cmdclass={"build_ext": BuildKernels},
)
