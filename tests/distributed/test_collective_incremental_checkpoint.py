"""Incremental checkpoints per shard in collective mode, restored at
another worker count and at the same one (issue 26.2). The checks run
inside collective_incremental.py on every worker (see its docstring);
horovodrun exits non-zero if any fails.
"""

import pytest
from test_collective_training import run_workers


@pytest.mark.parametrize("restore_at", [1, 2], ids=lambda n: f"np{n}")
def test_deltas_at_two_workers_restore_at(tmp_path, restore_at):
    args = ["--dir", str(tmp_path)]
    saved = run_workers(2, "collective_incremental.py", "--phase", "save",
                        *args)
    out = saved.stdout + saved.stderr
    assert saved.returncode == 0, out[-4000:]
    assert out.count("saved full + 2 deltas") == 2, out[-4000:]
    restored = run_workers(restore_at, "collective_incremental.py",
                           "--phase", "restore", *args)
    out = restored.stdout + restored.stderr
    assert restored.returncode == 0, out[-4000:]
    assert out.count("restored the chain, states equal") == restore_at, \
        out[-4000:]
    kind = "delta" if restore_at == 2 else "full"
    assert out.count(f"saved again ({kind}), restores equal") == \
        restore_at, out[-4000:]
