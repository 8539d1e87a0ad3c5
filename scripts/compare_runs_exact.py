"""Are two runs the same run? For refactors that must not change behaviour (issue 16):

    python scripts/compare_runs_exact.py RUN_A RUN_B

Compares metrics.jsonl line by line and summary.json key by key, leaving out what differs
between identical runs by construction (time/, mem/, rollout/tokens_per_s, run_dir,
wall_time_s), and each eval record file byte for byte. Prints one verdict line per part.
"""
import json, sys
from pathlib import Path
a, b = Path(sys.argv[1]), Path(sys.argv[2])
drop = ("time/", "mem/", "rollout/tokens_per_s")
def lines(p):
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(drop)} for x in (p / "metrics.jsonl").read_text().splitlines()]
la, lb = lines(a), lines(b)
print("metrics lines", len(la), len(lb), "equal" if la == lb else "DIFFER")
for i, (x, y) in enumerate(zip(la, lb)):
    if x != y:
        ks = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        print("first differing line", i, ks[:10]); break
sa, sb = json.loads((a / "summary.json").read_text()), json.loads((b / "summary.json").read_text())
skip = ("run_dir", "wall_time_s")
def clean(s): return {k: v for k, v in s.items() if k not in skip and not k.startswith(drop)}
ca, cb = clean(sa), clean(sb)
print("summary", "equal" if ca == cb else "DIFFER", sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k)))
for f in sorted((a / "eval").glob("*.jsonl")):
    g = b / "eval" / f.name
    print(f.name, "identical" if g.exists() and f.read_bytes() == g.read_bytes() else "DIFFER")
