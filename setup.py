"""Installs group-embedding as ONE import namespace, `group_embedding`.

`feature_column/` and `ops/` live at the top of the repository (the design
card's layout) and are mapped to `group_embedding.feature_column` and
`group_embedding.ops` with `package_dir`. The C++ kernels are compiled
against the installed TensorFlow by `scripts/setup.sh` (or on first use).

GPU: replace `tensorflow-cpu` by `tensorflow[and-cuda]==2.21.0`; the lookup
then runs its pure-TF path, which has GPU kernels.
"""

import setuptools

setuptools.setup(
    name="group-embedding",
    version="0.1.0",
    description="Grouped embedding lookups, EmbeddingVariable, feature "
                "columns and collective training for stock TensorFlow 2.",
    python_requires=">=3.9",
    packages=[
        "group_embedding",
        "group_embedding.distributed",
        "group_embedding.embedding_variable",
        "group_embedding.optimizers",
        "group_embedding.train",
        "group_embedding.feature_column",
        "group_embedding.ops",
    ],
    package_dir={
        "group_embedding": "group_embedding",
        "group_embedding.distributed": "group_embedding/distributed",
        "group_embedding.embedding_variable": "group_embedding/embedding_variable",
        "group_embedding.optimizers": "group_embedding/optimizers",
        "group_embedding.train": "group_embedding/train",
        "group_embedding.feature_column": "feature_column",
        "group_embedding.ops": "ops",
    },
    package_data={"group_embedding.ops": ["kernels/*.cc"]},
    install_requires=[
        "tensorflow-cpu==2.21.0",
        "numpy>=1.26,<3",
        "pandas>=2.0,<4",
    ],
    extras_require={
        "test": ["pytest>=8,<10"],
        "demo": ["matplotlib>=3.7,<4"],
    },
)
