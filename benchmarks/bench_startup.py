"""Time `LLM(...)` to ready, each layout in a fresh Python process, with the engine's own
start-up timeline (longserve/startup.py), then serve a few prompts and stop.

`--cold` gives every run an empty kernel cache (`LONGSERVE_CACHE` in a new folder): what a
fresh machine pays. Without it the runs share one cache folder, so the first run of a layout
fills it and the next ones read it (`--repeat 2`: cold-ish, then warm).

    python benchmarks/bench_startup.py --runs tp2:qwen3-0.6b-shape 1:llama3-8b-shape --repeat 2
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LAYOUTS = {"1": {}, "tp2": dict(tensor_parallel_size=2), "tp4": dict(tensor_parallel_size=4),
           "pcp2": dict(prefill_context_parallel_size=2), "pcp4": dict(prefill_context_parallel_size=4),
           "dp2-ep": dict(data_parallel_size=2, enable_expert_parallel=True),
           "dp4-ep": dict(data_parallel_size=4, enable_expert_parallel=True)}
CHILD = r"""
import json, logging, os, sys, time
if os.environ.get("BENCH_LOG"):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
t_proc = float(os.environ["BENCH_T0"])
t = time.time()
from longserve import LLM, SamplingParams
t_llm = time.time()
llm = LLM("builtin:" + sys.argv[1], load_format="dummy", **json.loads(sys.argv[2]))
ready = time.time()
prompts = [{"prompt_token_ids": [1 + i % 500 for i in range(n)]} for n in (3, 100, 1000)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
served = time.time()
llm.shutdown()
print("RESULT " + json.dumps(dict(python_start_s=t - t_proc, import_s=t_llm - t, start_s=ready - t_llm,
      serve_s=served - ready, phases=llm.engine.startup_phases, startup=llm.engine.startup)))
"""


def run_one(model: str, layout: str, extra: dict, env: dict) -> dict:
    kwargs = {**LAYOUTS[layout], **extra}
    env = {**env, "BENCH_T0": repr(time.time())}
    out = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(kwargs)], env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        print(out.stderr[-3000:], file=sys.stderr)
        return dict(error=out.returncode)
    compiles = [ln for ln in out.stderr.splitlines() if "compiled while serving" in ln]
    if env.get("BENCH_LOG"):
        print(out.stderr[-6000:])
    return dict(json.loads(lines[0][7:]), compiled_after_ready=compiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", default=["tp2:qwen3-0.6b-shape"], help="layout:model")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="an empty kernel cache for every run")
    ap.add_argument("--engine-args", default="{}", help="JSON keywords for every LLM(...)")
    ap.add_argument("--cache-dir", help="the runs' shared LONGSERVE_CACHE (default: a new folder)")
    args = ap.parse_args()
    shared = args.cache_dir or tempfile.mkdtemp(prefix="ls-startup-cache-")
    rows = []
    for spec in args.runs:
        layout, model = spec.split(":")
        for i in range(args.repeat):
            cache = tempfile.mkdtemp(prefix="ls-startup-cold-") if args.cold else shared
            env = {**os.environ, "LONGSERVE_CACHE": cache}
            r = run_one(model, layout, json.loads(args.engine_args), env)
            r.update(layout=layout, model=model, run=i)
            rows.append(r)
            if "error" in r:
                print(f"{spec} run {i}: failed ({r['error']})", flush=True)
                continue
            print(f"{spec} run {i}: ready {r['start_s']:.2f} s after LLM() (imports {r['import_s']:.2f} s, "
                  f"python {r['python_start_s']:.2f} s); first prompts served in {r['serve_s']:.2f} s; "
                  f"{len(r['compiled_after_ready'])} kernels compiled after ready\n  {r['startup']}",
                  flush=True)
            for line in r["compiled_after_ready"][:5]:
                print("   ", line)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
