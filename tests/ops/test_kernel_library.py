"""Kernel library cache: verification before loading (issue 10, point 4),
the user-cache location and `python -m group_embedding` (issue 13).

A truncated library under its final name used to be loaded and killed the
process with SIGBUS; now every library has a record (size, sha256, TF
version, sources digest) and one that does not match it is rebuilt.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import tensorflow as tf

from group_embedding.ops import config
from group_embedding.ops import kernel_library

_LOOKUP = r"""
import json, os
import numpy as np
import tensorflow as tf
import group_embedding as ge
from group_embedding.ops import kernel_library

table = tf.Variable(np.arange(40, dtype=np.float32).reshape(10, 4))
ids = tf.ragged.constant([[1, 3, 3], [], [9]], tf.int64)
(got,) = ge.group_embedding_lookup_sparse([table], [ids], "mean")
want = tf.nn.embedding_lookup_sparse(table, ids.to_sparse(), None,
                                     combiner="mean")
want = tf.concat([want, tf.zeros([3 - tf.shape(want)[0], 4])], 0)
np.testing.assert_allclose(got.numpy(), want.numpy())
ev = ge.get_embedding_variable("ev", 4)
(emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
assert emb.shape == (3, 4)
print(json.dumps(kernel_library.status()))
"""


def _env(cache):
    env = dict(os.environ, GROUP_EMBEDDING_CACHE=str(cache),
               GROUP_EMBEDDING_KERNELS="custom", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("PYTHONPATH", None)
    return env


def _fake_library(folder, content=b"\x7fELF not really a library"):
    path = folder / "_group_embedding_ops_test.so"
    path.write_bytes(content)
    record = folder / "_group_embedding_ops_test.json"
    record.write_text(json.dumps({
        "file": path.name, "size": len(content),
        "sha256": hashlib.sha256(content).hexdigest(),
        "tensorflow": tf.__version__,
        "sources": kernel_library.sources_digest(), "native": True}))
    return path, record


def test_verify_accepts_only_what_the_record_describes(tmp_path):
    path, record = _fake_library(tmp_path)
    assert kernel_library.verify(str(path), str(record)) is None

    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    assert "truncated" in kernel_library.verify(str(path), str(record))

    path.write_bytes(data[:-1] + b"X")  # same size, other bytes
    assert "sha256" in kernel_library.verify(str(path), str(record))

    path, record = _fake_library(tmp_path)
    meta = json.loads(record.read_text())
    record.write_text(json.dumps(dict(meta, tensorflow="2.0.0")))
    assert "TensorFlow 2.0.0" in kernel_library.verify(str(path), str(record))
    record.write_text(json.dumps(dict(meta, sources="0" * 16)))
    assert "other kernel sources" in kernel_library.verify(str(path),
                                                           str(record))
    record.unlink()  # a build that crashed before writing its record
    assert "record" in kernel_library.verify(str(path), str(record))


def test_cache_is_outside_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("GROUP_EMBEDDING_CACHE", str(tmp_path / "c"))
    assert kernel_library.cache_path().startswith(str(tmp_path / "c") + "/")
    monkeypatch.delenv("GROUP_EMBEDDING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir() == str(tmp_path / "xdg"
                                             / "group_embedding")
    package = os.path.dirname(kernel_library.__file__)
    assert not kernel_library.cache_path().startswith(package)


def test_truncated_cached_library_is_rebuilt_not_loaded(tmp_path):
    """The regression of issue 10.4: truncate the cached library (same
    name), then import and look up in a fresh process: no crash, the
    library is rebuilt and the results are right."""
    good = kernel_library.build()  # compiled once for the whole suite
    cache = tmp_path / "cache"
    cache.mkdir()
    env = _env(cache)
    name = subprocess.run(
        [sys.executable, "-c", "from group_embedding.ops import "
         "kernel_library as k; print(k.cache_path())"],
        env=env, capture_output=True, text=True, check=True,
        timeout=300).stdout.strip().splitlines()[-1]
    assert os.path.dirname(name) == str(cache)
    shutil.copy(good, name)
    shutil.copy(kernel_library._record_of(good),  # pylint: disable=protected-access
                kernel_library._record_of(name))  # pylint: disable=protected-access
    # Same name, same record, half the bytes: what a crash mid-copy (or a
    # full disk) leaves behind.
    size = os.path.getsize(name)
    with open(name, "r+b") as f:
        f.truncate(size // 2)

    result = subprocess.run([sys.executable, "-c", _LOOKUP], env=env,
                            capture_output=True, text=True, timeout=1500,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    status = json.loads(result.stdout.strip().splitlines()[-1])
    assert status["loaded"] and status["path"] == name
    assert os.path.getsize(name) > size // 2
    with open(kernel_library._record_of(name)) as f:  # pylint: disable=protected-access
        assert json.load(f)["size"] == os.path.getsize(name)


def test_ge_info_reports_kernels_horovod_threads():
    result = subprocess.run([sys.executable, "-m", "group_embedding"],
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert f"tensorflow {tf.__version__}" in out
    assert "kernels: loaded from the " in out
    assert "horovod: " in out
    assert "threads: intra-op " in out


def test_unavailable_kernels_warn_once_with_the_reason(tmp_path):
    """No compiler: the first lookup warns (reason + command) and falls
    back; EmbeddingVariables fail."""
    script = r"""
import warnings
import numpy as np
import tensorflow as tf
import group_embedding as ge
table = tf.Variable(np.ones([4, 2], np.float32))
ids = tf.ragged.constant([[1], [2, 3]], tf.int64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        (out,) = ge.group_embedding_lookup_sparse([table], [ids], "sum")
msgs = [str(w.message) for w in caught if "kernels unavailable" in
        str(w.message)]
assert len(msgs) == 1, msgs
assert "no C++ compiler" in msgs[0], msgs[0]
assert "python -m group_embedding.ops.kernel_library -v" in msgs[0]
np.testing.assert_allclose(out.numpy(), [[1, 1], [2, 2]])
try:
    ge.get_embedding_variable("ev", 2)
except RuntimeError as e:
    print("EV error:", e)
else:
    raise AssertionError("EV without kernels must fail")
"""
    env = _env(tmp_path / "empty_cache")
    env.update(GROUP_EMBEDDING_KERNELS="auto", CXX="/nonexistent/g++")
    result = subprocess.run([sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "EV error:" in result.stdout
