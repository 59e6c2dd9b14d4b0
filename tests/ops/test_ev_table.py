"""The GPU EV table (`ops/cuda/ev_table.h`) checked without a GPU.

* every parity case of `ev_table_parity.py` (the ones the GPU machine runs
  on the CUDA table) through the host stand-in, against the numpy model
  of the CPU EV;
* negative controls: a model that evicts by the other policy, or forgets
  one occurrence's count, fails a case (the cases can catch both);
* the CUDA table compiles with PyPI's nvcc (with the rest of the core:
  `tests/ops/test_cuda_core.py` builds it).
"""

import pytest

from group_embedding.ops import gpu_kernel_library

import ev_table_parity


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    path = tmp_path_factory.mktemp("ev_core") / "libge_host.so"
    core = ev_table_parity.cc.Core(
        gpu_kernel_library.compile_host_core(str(path)))
    return ev_table_parity.Context(core, ev_table_parity.cc.HostMemory())


CASES = ev_table_parity.all_cases()


@pytest.mark.parametrize("name,case", CASES, ids=[n for n, _ in CASES])
def test_host_stand_in_parity(ctx, name, case):
    case(ctx)


def test_cases_catch_the_wrong_policy(ctx, monkeypatch):
    """A model that evicts the newest key instead of the oldest fails the
    LRU case."""
    real = ev_table_parity.Model._victim

    def newest(self, bucket):
        free = {k: e for k, e in bucket.items() if e[3] < self.now}
        if not free:
            return None
        return max(free, key=lambda k: (free[k][3], free[k][4]))

    monkeypatch.setattr(ev_table_parity.Model, "_victim", newest)
    with pytest.raises(ev_table_parity.Failure):
        ev_table_parity.case_capacity_eviction(ctx, "lru", 5)
    monkeypatch.setattr(ev_table_parity.Model, "_victim", real)


def test_cases_catch_a_lost_count(ctx, monkeypatch):
    """A model that counts a repeated key once per batch fails the
    CounterFilter case."""
    real = ev_table_parity.Model.find_or_insert

    def once(self, keys, step):
        seen = {}
        for k in keys:
            seen[int(k)] = seen.get(int(k), 0) + 1
        rows, stored, evicted, full = real(self, keys, step)
        for k, c in seen.items():
            e = self.bucket(k).get(k)
            if e is not None and c > 1:
                e[2] -= c - 1
        return rows, stored, evicted, full

    monkeypatch.setattr(ev_table_parity.Model, "find_or_insert", once)
    with pytest.raises(ev_table_parity.Failure):
        ev_table_parity.case_counter_filter(ctx, 3)
