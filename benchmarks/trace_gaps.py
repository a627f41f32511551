"""Where a profiled step's device sits idle, from a torch profiler chrome trace.

    BENCH_TRACE=/tmp/t.json python benchmarks/bench_capacity.py ... --profile-chunk 5
    python benchmarks/trace_gaps.py /tmp/t.json

Prints the device's span, busy time and idle gaps (largest first, with the kernels on either
side), kernel time by name, and the host's blocking CUDA calls (synchronizations and copies the
host waits for): a gap after a synchronization is the host's time, not the device's. Then the
host's own thread: its ops by time (inclusive) and its longest stretches inside no op (Python:
where an engine core plans and applies a step; the twelfth session's tp=4 trace, docs).
"""
import json
import sys
from collections import defaultdict

BLOCKING = ("Synchronize", "cudaMemcpy", "cudaStreamWaitEvent")


def main(path: str, top: int = 15) -> None:
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        sys.exit("no device events in the trace")
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, gaps, last_end, last = 0.0, [], start, None
    for e in kernels:  # streams overlap: busy is the union of the kernels' intervals
        if e["ts"] > last_end:
            gaps.append((e["ts"] - last_end, last["name"] if last else "", e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], last_end))
        if e["ts"] + e["dur"] >= last_end:
            last_end, last = e["ts"] + e["dur"], e
    print(f"device span {(end - start) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
          f"idle {(end - start - busy) / 1e3:.2f} ms in {len(gaps)} gaps")
    print(f"\nlargest gaps (us, kernel before -> kernel after):")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"  {g:9.1f}  {a[:60]} -> {b[:60]}")
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"][:90]][0] += 1
        by_name[e["name"][:90]][1] += e["dur"]
    print("\nkernels by device time (ms, calls):")
    for name, (n, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {d / 1e3:9.2f} {n:6d}  {name}")
    host = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(b in e["name"] for b in BLOCKING):
            host[e["name"]][0] += 1
            host[e["name"]][1] += e["dur"]
    print("\nhost CUDA calls that can block (ms, calls):")
    for name, (n, d) in sorted(host.items(), key=lambda kv: -kv[1][1]):
        print(f"  {d / 1e3:9.2f} {n:6d}  {name}")
    host_thread(events, top)


def host_thread(events: list, top: int) -> None:
    """The thread with the most ops: its ops by time, and the gaps between them (no op running)."""
    ops = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    if not ops:
        return
    counts = defaultdict(int)
    for e in ops:
        counts[e.get("tid")] += 1
    tid = max(counts, key=counts.get)
    ops = sorted((e for e in ops if e.get("tid") == tid), key=lambda e: e["ts"])
    by_name, gaps, last_end, last = defaultdict(lambda: [0, 0.0]), [], ops[0]["ts"], ""
    for e in ops:
        by_name[e["name"][:70]][0] += 1
        by_name[e["name"][:70]][1] += e["dur"]
        if e["ts"] > last_end:
            gaps.append((e["ts"] - last_end, last, e["name"]))
        if e["ts"] + e["dur"] >= last_end:
            last_end, last = e["ts"] + e["dur"], e["name"]
    print(f"\nhost thread {tid}: ops by time (ms inclusive, calls):")
    for name, (n, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {d / 1e3:9.2f} {n:6d}  {name}")
    print(f"\nits longest stretches in no op (us, {sum(g for g, _, _ in gaps) / 1e3:.2f} ms in all):")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"  {g:9.1f}  after {a[:50]} -> {b[:50]}")


if __name__ == "__main__":
    main(sys.argv[1])
