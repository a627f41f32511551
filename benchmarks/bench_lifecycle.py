"""Start, use and stop multi-GPU engines one after another in one process, as the benchmarks do.

For each layout: build an `LLM` (engine core in its own process, NCCL, CUDA graphs unless
`-eager`), generate a few prompts, then time `shutdown()` and the exit of the last process of
its tree (each must exit by itself with code 0), and read the GPUs' used memory before the
next engine starts (it must be back to what it was before the first). Then, in child
processes: a front end killed with SIGKILL (every process of its tree gone within 10 s), and
`CUDA_VISIBLE_DEVICES=1` (the engine runs on GPU 1, nothing on GPU 0).

    python benchmarks/bench_lifecycle.py --layouts tp2 pcp2 tp2-dcp2 dp2 tp2-eager
"""
import argparse
import os
import signal
import subprocess
import sys
import time

import psutil
import torch

from longserve import LLM, SamplingParams

LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pcp2": dict(prefill_context_parallel_size=2),
           "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
           "dp2": dict(data_parallel_size=2), "tp2-eager": dict(tensor_parallel_size=2, enforce_eager=True),
           "tp1": dict()}
PROMPTS = [{"prompt_token_ids": [1 + i % 500 for i in range(n)]} for n in (16, 100, 300, 1000)]


def gpu_used_mib() -> list[int]:
    if not torch.cuda.is_available():  # a dry run on CPU (--device cpu)
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def tree_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def wait_all_gone(procs: list[psutil.Process], timeout: float) -> float | None:
    """Seconds until none of `procs` runs (zombies count as gone), None after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def one_engine(args, name: str) -> dict:
    before, t_start = gpu_used_mib(), time.monotonic()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, device=args.device,
              max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
              **LAYOUTS[name])
    start_s = time.monotonic() - t_start
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    tree, cores = tree_of(os.getpid()), list(llm.engine.client.procs.values())
    during = gpu_used_mib()
    t0 = time.monotonic()
    llm.shutdown()
    shutdown_s = time.monotonic() - t0
    gone_s = wait_all_gone(tree, 30)
    return dict(layout=name, start_s=round(start_s, 1), shutdown_s=round(shutdown_s, 2),
                last_exit_s=None if gone_s is None else round(shutdown_s + gone_s, 2),
                core_exit=[c.returncode for c in cores], procs=len(tree),
                gpu_mib_before=before, gpu_mib_running=during, gpu_mib_after=gpu_used_mib())


FRONT_END = """
import sys
from longserve import LLM, SamplingParams
llm = LLM({model!r}, load_format="dummy", max_model_len=4096, device={device!r},
          gpu_memory_utilization=0.5, **{layout!r})
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
print("ready", flush=True)
sys.stdin.read()
"""


def killed_front_end(args, name: str) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", FRONT_END.format(model=args.model, layout=LAYOUTS[name], device=args.device)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    tree = tree_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone_s = wait_all_gone(tree, 20)
    time.sleep(1)
    return dict(layout=f"{name}, front end SIGKILLed", procs=len(tree), all_gone_s=gone_s,
                gpu_mib_after=gpu_used_mib())


def pinned_to_gpu1(args) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    proc = subprocess.Popen([sys.executable, "-c", FRONT_END.format(model=args.model, layout={}, device=args.device)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    used = gpu_used_mib()
    proc.stdin.close()  # the script ends: the LLM is shut down at exit
    t0 = time.monotonic()
    code = proc.wait(60)
    return dict(layout="CUDA_VISIBLE_DEVICES=1", gpu_mib_running=used, exit=code,
                exit_s=time.monotonic() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin:qwen3-0.6b-shape")
    p.add_argument("--layouts", nargs="+", default=["tp2", "pcp2", "tp2-dcp2", "dp2", "tp2-eager"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-num-seqs", type=int, default=16, help="fewer decode graphs: a faster start")
    p.add_argument("--pinned", action=argparse.BooleanOptionalAction, default=True,
                   help="also CUDA_VISIBLE_DEVICES=1")
    p.add_argument("--kill", nargs="*", default=["tp2", "dp2"], help="layouts whose front end is SIGKILLed")
    args = p.parse_args()
    for name in args.layouts:  # each row as it comes (a run cut short still reports)
        print(one_engine(args, name), flush=True)
    for name in args.kill:
        print(killed_front_end(args, name), flush=True)
    if args.pinned:
        print(pinned_to_gpu1(args), flush=True)


if __name__ == "__main__":
    main()
