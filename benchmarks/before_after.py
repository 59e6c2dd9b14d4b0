"""A refactor's speed check: lookup_bench and scaling_bench on two checkouts.

Runs the two benchmarks against a "before" and an "after" checkout of this
repository on the same machine, alternating (before, after, before, ...)
so that drift of the machine's load hits both sides alike, and writes one
JSON with every launch's numbers and the after/before ratio of the medians.

Both checkouts are imported through the same interpreter and packages (this
repository's `.venv`): a generated `sitecustomize.py` on `PYTHONPATH` points
`group_embedding` (and its `feature_column` / `ops` subpackages) at the
checkout under test, in every process the benchmark starts, Horovod's
workers included. Each side builds its C++ kernels into its own cache.

    git worktree add --detach /tmp/before <commit>
    git worktree add --detach /tmp/after HEAD
    .venv/bin/python benchmarks/before_after.py /tmp/before /tmp/after
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(_HERE, "results", "before_after.json")
# The library's own paths of lookup_bench (the stock rows do not change
# with a refactor of the library).
LOOKUP_VARIANTS = ("ge,ge_packed,ge_seq,ge_max_norm,ge_weighted,ge_ev,"
                   "ge_infer,ge_tf1")

# Imported by every Python process started with PYTHONPATH=<its folder>.
_SITECUSTOMIZE = '''
import os, sys
from importlib.util import spec_from_file_location
from pathlib import Path
_tree = os.environ["GE_BEFORE_AFTER_TREE"]
_MAP = {"group_embedding": _tree + "/group_embedding",
        "group_embedding.feature_column": _tree + "/feature_column",
        "group_embedding.ops": _tree + "/ops"}
class _TreeFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        for pkg, root in reversed(list(_MAP.items())):
            if fullname == pkg or fullname.startswith(pkg + "."):
                rest = [p for p in fullname[len(pkg):].split(".") if p]
                cand = Path(root, *rest)
                for f in (cand / "__init__.py", cand.with_suffix(".py")):
                    if f.exists():
                        return spec_from_file_location(fullname, f)
                return None
        return None
sys.meta_path.insert(0, _TreeFinder)
'''


def _run(tree, site, cache, argv, label):
    """Runs one benchmark script of `tree` with `tree` as the library."""
    env = dict(os.environ, GE_BEFORE_AFTER_TREE=tree, PYTHONPATH=site,
               GROUP_EMBEDDING_CACHE=cache, TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable] + argv, cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{label} failed (exit {proc.returncode})")
    print(f"  {label}: {time.perf_counter() - start:.0f} s", flush=True)


def _lookup(tree, site, cache, out, rounds):
    _run(tree, site, cache,
         ["benchmarks/lookup_bench.py", "--variants", LOOKUP_VARIANTS,
          "--rounds", str(rounds), "--out", out], "lookup_bench")
    with open(out) as f:
        results = json.load(f)["results"]
    return {name: r["median_step_s"] * 1e3 for name, r in results.items()}


def _scaling(tree, site, cache, out, launches):
    _run(tree, site, cache,
         ["benchmarks/scaling_bench.py", "--sizes", "1,2",
          "--launches", str(launches), "--out", out], "scaling_bench")
    with open(out) as f:
        record = json.load(f)
    return {"n1_step_ms": record["results"]["1"]["median_step_ms"],
            "n2_step_ms": record["results"]["2"]["median_step_ms"],
            "efficiency_n2": record["weak_scaling_efficiency_n2"]}


def _summary(launches):
    """Median over launches per metric, and after/before ratios."""
    out = {}
    for metric in launches[0]["before"]:
        before = statistics.median(x["before"][metric] for x in launches)
        after = statistics.median(x["after"][metric] for x in launches)
        out[metric] = {"before": before, "after": after,
                       "after_over_before": after / before}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", help="checkout measured first")
    parser.add_argument("after", help="checkout measured second")
    parser.add_argument("--launches", type=int, default=3,
                        help="alternating launches per side (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="lookup_bench rounds per launch")
    parser.add_argument("--scaling-launches", type=int, default=2,
                        help="scaling_bench's own --launches per launch")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before),
             "after": os.path.abspath(args.after)}
    commits = {side: subprocess.run(
        ["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True,
        text=True, check=True).stdout.strip()
        for side, tree in trees.items()}
    work = tempfile.mkdtemp(prefix="ge_before_after_")
    site = os.path.join(work, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    lookup, scaling = [], []
    start = time.time()
    for launch in range(args.launches):
        rows_l, rows_s = {}, {}
        for side, tree in trees.items():
            print(f"launch {launch + 1}/{args.launches}: {side}", flush=True)
            cache = os.path.join(work, f"cache_{side}")
            rows_l[side] = _lookup(tree, site, cache,
                                   os.path.join(work, f"l{launch}{side}.json"),
                                   args.rounds)
            rows_s[side] = _scaling(tree, site, cache,
                                    os.path.join(work, f"s{launch}{side}.json"),
                                    args.scaling_launches)
        lookup.append(rows_l)
        scaling.append(rows_s)
    record = {
        "commits": commits, "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "wall_s": time.time() - start,
        "lookup_bench_ms": _summary(lookup),
        "scaling_bench": _summary(scaling),
        "launches": {"lookup_bench_ms": lookup, "scaling_bench": scaling},
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for family in ("lookup_bench_ms", "scaling_bench"):
        for metric, row in record[family].items():
            print(f"{family:16s} {metric:16s} before {row['before']:8.3f}  "
                  f"after {row['after']:8.3f}  after/before "
                  f"{row['after_over_before']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
