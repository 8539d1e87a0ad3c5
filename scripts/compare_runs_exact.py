"""Are two runs the same run? For refactors that must not change behaviour (issue 16):

    python scripts/compare_runs_exact.py RUN_A RUN_B

Compares metrics.jsonl line by line and summary.json key by key, leaving out what differs
between identical runs by construction (keel.metrics.NONDETERMINISTIC_PREFIXES, run_dir,
wall_time_s), and each eval record file byte for byte. Prints one verdict line per part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from keel.metrics import NONDETERMINISTIC_PREFIXES
from keel.rundir import read_jsonl


def _kept(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("run_dir", "wall_time_s") and not k.startswith(NONDETERMINISTIC_PREFIXES)}


def main() -> None:
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    la, lb = ([_kept(x) for x in read_jsonl(p / "metrics.jsonl")[0]] for p in (a, b))
    print("metrics lines", len(la), len(lb), "equal" if la == lb else "DIFFER")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            print("first differing line", i, sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))[:10])
            break
    sa, sb = (_kept(json.loads((p / "summary.json").read_text())) for p in (a, b))
    print("summary", "equal" if sa == sb else "DIFFER", sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k)))
    for f in sorted((a / "eval").glob("*.jsonl")):
        g = b / "eval" / f.name
        print(f.name, "identical" if g.exists() and f.read_bytes() == g.read_bytes() else "DIFFER")


if __name__ == "__main__":
    main()
