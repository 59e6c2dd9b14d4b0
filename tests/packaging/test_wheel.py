"""Issue 13: a built wheel works like the editable install.

Builds the wheel from a copy of the working tree (as `pip wheel .` would,
`--no-build-isolation` to reuse the installed TensorFlow), installs it into
a fresh venv that sees this environment's packages through a `.pth` file
(a cached TF, no download), and from outside the repository checks that
the packaged kernels are loaded (not compiled, not the pure-TF fallback)
and that an EV lookup + Adagrad step equals the same step on stock ops.
"""

import email
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tensorflow as tf

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
_SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__",
              ".pytest_cache", "tmp"}
_SKIP_SUFFIXES = (".egg-info", ".so", ".lock", ".pyc", ".json.tmp")


def _ignore(folder, names):
    # What a fresh clone would not have: builds, caches, the venv.
    return [n for n in names
            if n in _SKIP_DIRS or n.endswith(_SKIP_SUFFIXES)
            or ".so.tmp" in n]


def _run(cmd, timeout, **kwargs):
    result = subprocess.run([str(c) for c in cmd], capture_output=True,
                            text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} failed ({result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from a clean copy of the working tree."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(REPO, src, ignore=_ignore)
    # On a fresh machine the build runs before anything named
    # group_embedding is installed; here the editable install is, so a
    # `group_embedding` that fails to import shadows it for the build (CI
    # once failed on a build step that imported the package).
    poison = work / "poison" / "group_embedding"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text(
        "raise ImportError('the build imported group_embedding, which a "
        "fresh machine does not have yet')\n")
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
          "--no-deps", "-w", work / "dist", src], timeout=1500,
         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
              "PYTHONPATH": str(poison.parent)})
    (whl,) = (work / "dist").glob("group_embedding-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed; (python, site-packages)."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", root], timeout=300)
    purelib = Path(sysconfig.get_path(
        "purelib", vars={"base": str(root), "platbase": str(root)}))
    # TF, numpy, pandas, keras come from this environment; the venv's own
    # site-packages precedes them, so its group_embedding wins.
    (purelib / "_cached_deps.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n")
    python = root / "bin" / "python"
    # --force-reinstall: pip would otherwise take the editable install it
    # sees through the .pth for this very version and install nothing.
    _run([sys.executable, "-m", "pip", "--python", python, "install",
          "--no-index", "--no-deps", "--force-reinstall", wheel],
         timeout=600)
    return python, purelib


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = json.loads(zf.read("group_embedding/ops/"
                                    "_group_embedding_ops.json"))
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
        entry_points = [zf.read(n).decode() for n in names
                        if n.endswith(".dist-info/entry_points.txt")]
    ops = "group_embedding/ops/"
    assert ops + record["file"] in names
    assert record["file"].startswith("_group_embedding_ops")
    assert record["tensorflow"] == tf.__version__
    assert not record["native"]  # portable: the wheel may go elsewhere
    kernels = [p.name for p in (REPO / "ops" / "kernels").iterdir()
               if p.suffix in (".cc", ".h")]
    assert "pooling.h" in kernels and "ev_storage.h" in kernels
    for name in kernels:
        assert ops + "kernels/" + name in names
    assert "group_embedding/__main__.py" in names
    # The CUDA sources ship for the GPU library's build on first use.
    for path in (REPO / "ops" / "cuda").iterdir():
        assert ops + "cuda/" + path.name in names, path.name
    # Every package of the tree ships (the mapped folders included).
    for top, target in (("group_embedding", "group_embedding"),
                        ("feature_column", "group_embedding/feature_column"),
                        ("ops", "group_embedding/ops")):
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.relative_to(REPO / top).as_posix()
            assert f"{target}/{rel}" in names, rel
    assert any(n.endswith(".dist-info/licenses/LICENSE")
               or n.endswith(".dist-info/LICENSE") for n in names)
    assert not [n for n in names if n.endswith(".so")
                and n != ops + record["file"]]
    assert "-none-any" not in wheel.name  # the .so is platform-specific
    assert meta["License"] == "Apache-2.0"
    assert set(meta.get_all("Provides-Extra")) >= {"test", "demo", "tf1",
                                                   "bench"}
    assert "tensorflow-cpu==2.21.0" in meta.get_all("Requires-Dist")
    assert "# group-embedding" in meta.get_payload()  # the README
    assert entry_points and "ge-info = group_embedding.__main__:main" in \
        entry_points[0]


def test_installed_wheel_trains_on_packaged_kernels(venv, tmp_path):
    python, purelib = venv
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(GROUP_EMBEDDING_CACHE=str(cache), TF_CPP_MIN_LOG_LEVEL="2",
               GROUP_EMBEDDING_KERNELS="custom")
    script = tmp_path / "wheel_check.py"
    shutil.copy(Path(__file__).with_name("wheel_check.py"), script)
    result = _run([python, script, purelib], timeout=600, cwd=tmp_path,
                  env=env)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    status = report["status"]
    assert status["loaded"] and status["origin"] == "package", status
    assert Path(status["path"]).parent == purelib / "group_embedding" / "ops"
    assert status["built_for"] == tf.__version__
    # Nothing compiled on first use: the wheel's library was enough.
    assert not cache.exists() or not any(cache.iterdir())

    info = _run([python.parent / "ge-info"], timeout=300, cwd=tmp_path,
                env=env).stdout
    assert f"tensorflow {tf.__version__}" in info
    assert "kernels: loaded from the package" in info
    assert "horovod: " in info and "threads: intra-op " in info
