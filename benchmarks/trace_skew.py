"""Which rank the others wait for, from every rank's timeline of the same steps.

    LONGSERVE_TRACE=/tmp/tr:16:3 python benchmarks/bench_capacity.py ...   # rank<R>.json each
    python benchmarks/trace_skew.py /tmp/tr

A collective's kernel runs from when its rank reaches it until the last rank does and the data
has moved: the i-th NCCL kernel of a name is the same collective on every rank (one group
spanning the ranks: pcp=4, tp=4), its shortest duration over the ranks is the transfer, and
each rank's excess over it is time spent waiting for a slower rank. Prints, per rank, the
collectives' device time, the part of it that was waiting, and how often that rank was the last
to arrive (the one the others waited for)."""
import glob
import json
import os
import sys
from collections import defaultdict


def collectives(path: str) -> dict[str, list[float]]:
    """name -> durations (us) of that NCCL kernel, in launch order."""
    events = [e for e in json.load(open(path))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") == "kernel" and "nccl" in e.get("name", "").lower()]
    by_name = defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        by_name[e["name"]].append(e["dur"])
    return by_name


def main(folder: str) -> None:
    paths = sorted(glob.glob(os.path.join(folder, "rank*.json")))
    ranks = [collectives(p) for p in paths]
    total, waited, last = ([0.0] * len(ranks) for _ in range(3))
    for name in set.intersection(*(set(r) for r in ranks)):
        for durs in zip(*(r[name] for r in ranks)):  # the same collective on every rank
            floor = min(durs)
            for i, d in enumerate(durs):
                total[i] += d
                waited[i] += d - floor
            last[durs.index(floor)] += 1
    print("| rank | collectives (ms) | waiting for another rank (ms) | last to arrive (times) |")
    print("| --- | --- | --- | --- |")
    for path, t, w, n in zip(paths, total, waited, last):
        print(f"| {os.path.basename(path)[4:-5]} | {t / 1e3:.1f} | {w / 1e3:.1f} | {n:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
