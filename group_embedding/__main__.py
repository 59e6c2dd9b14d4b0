"""`python -m group_embedding` (also installed as `ge-info`).

Prints what a bug report needs: versions, where the C++ kernels come from
(or why they cannot be loaded), Horovod's status and the number of threads
TensorFlow will use. Exits 1 when the kernels are unavailable, so scripts
can check an installation with it.
"""

import importlib.metadata
import os
import platform
import sys


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _horovod():
    if _version("horovod") is None:
        return "not installed (build it with scripts/build_horovod.sh)"
    try:
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    except Exception as e:  # noqa: BLE001 - report whatever breaks it
        return f"{_version('horovod')}, but `import horovod.tensorflow` " \
               f"fails: {e}"
    backends = [name for name, built in (("gloo", hvd.gloo_built()),
                                          ("mpi", hvd.mpi_built()))
                if built]
    return f"{_version('horovod')} (controllers: {', '.join(backends)})"


def _threads(tf):
    # 0 means "TF decides": one thread per CPU this process may run on.
    cpus = len(os.sched_getaffinity(0))
    intra = tf.config.threading.get_intra_op_parallelism_threads()
    inter = tf.config.threading.get_inter_op_parallelism_threads()

    def describe(n):
        return f"{n} (set)" if n else f"{cpus} (default: CPUs available)"

    return f"intra-op {describe(intra)}, inter-op {describe(inter)}"


def main():
    """Prints the report; returns 0, or 1 if the kernels are unavailable."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import group_embedding  # pylint: disable=import-outside-toplevel
    from group_embedding.ops import config  # pylint: disable=import-outside-toplevel
    from group_embedding.ops import gpu_kernel_library  # pylint: disable=import-outside-toplevel
    from group_embedding.ops import kernel_library  # pylint: disable=import-outside-toplevel

    gpus = tf.config.list_physical_devices("GPU")
    print(f"group-embedding {group_embedding.__version__} "
          f"({os.path.dirname(group_embedding.__file__)})")
    print(f"python {platform.python_version()}, tensorflow {tf.__version__} "
          f"({len(gpus)} GPU), keras {_version('keras')}, "
          f"numpy {_version('numpy')}")
    status = kernel_library.status()
    if status["loaded"]:
        print(f"kernels: loaded from the {status['origin']} "
              f"({status['path']}), built for TensorFlow "
              f"{status['built_for']}; GROUP_EMBEDDING_KERNELS="
              f"{status['mode']}")
    else:
        print(f"kernels: UNAVAILABLE ({status['error']}); lookups run the "
              f"slow pure-TF path, EmbeddingVariables fail. Details: "
              f"`{kernel_library.DIAGNOSE_COMMAND}`")
    gpu = gpu_kernel_library.status()
    if gpu["loaded"]:
        print(f"GPU kernels: loaded ({gpu['path']}); GPU lookups of "
              "float32 variables run them")
    else:
        print(f"GPU kernels: not loaded ({gpu['error']}); CUDA compiler: "
              f"{gpu['nvcc'] or 'none found'}")
    print(f"kernel cache: {config.cache_dir()}")
    print(f"horovod: {_horovod()}")
    print(f"threads: {_threads(tf)}")
    return 0 if status["loaded"] else 1


if __name__ == "__main__":
    sys.exit(main())
