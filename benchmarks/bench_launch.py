"""Host microseconds to launch one op on this machine (one GPU): what an eager step pays per op.

Each op is called `--reps` times in a loop with no sync inside (tiny shapes: the GPU keeps up,
so the loop's time is the host's), for:
  torch.add / F.linear(1 x 4096, 4096 x 4096) / torch.empty: ATen dispatch and a launch;
  rms_norm (fused_ops): our fused RMSNorm as a layer calls it (Triton's JIT launch path:
      argument binding, the variant key, the launch) plus its output allocation;
  jit launch: the same Triton kernel through `kernel[grid](...)` alone;
  compiled launch: the CompiledKernel that call returned, launched directly (no binding, no
      variant lookup) -- what a launch cache keyed by the caller would cost.
With --collectives (two GPUs, two processes over NCCL): the host time of c10d's
all_gather_into_tensor and all_reduce of 8 KB, what eager PCP decode pays once a layer.
Run it under different TORCH_NCCL_* / TORCH_FR_* settings to see what they cost the host.

    python benchmarks/bench_launch.py [--collectives]
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.nn.functional as F


def host_us(fn, reps: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * elapsed / reps


def collectives(rank: int, port: int, reps: int) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2 * 4096, device="cuda", dtype=torch.bfloat16)
    rows = dict(all_gather=host_us(lambda: dist.all_gather_into_tensor(out, x), reps),
                all_reduce=host_us(lambda: dist.all_reduce(x), reps))
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "TORCH_FR"))}
        print(json.dumps({k: round(v, 2) for k, v in rows.items()} | dict(env=env)))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5000)
    p.add_argument("--collectives", action="store_true")
    args = p.parse_args()
    if args.collectives:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.spawn(collectives, args=(port, args.reps // 5), nprocs=2)
        return
    from longserve.models import fused_kernels as fk
    from longserve.models.fused_ops import rms_norm
    dev, dt = "cuda", torch.bfloat16
    a, b = torch.randn(4096, device=dev, dtype=dt), torch.randn(4096, device=dev, dtype=dt)
    x, w = torch.randn(1, 4096, device=dev, dtype=dt), torch.randn(4096, 4096, device=dev, dtype=dt)
    nw, out = torch.ones(4096, device=dev, dtype=dt), torch.empty(1, 4096, device=dev, dtype=dt)
    kargs = (x, x, nw, out, out, 4096, 4096, 4096, 4096, 1e-6)
    kw = dict(N=4096, BLOCK=4096, HAS_RES=False, num_warps=16)
    compiled = fk._rms_norm_kernel[(1,)](*kargs, **kw)
    all_args = kargs + (4096, 4096, False)  # the constexprs, in the kernel's argument order
    rows = dict(
        add=host_us(lambda: torch.add(a, b), args.reps),
        empty=host_us(lambda: torch.empty(1, 4096, device=dev, dtype=dt), args.reps),
        linear=host_us(lambda: F.linear(x, w), args.reps),
        rms_norm=host_us(lambda: rms_norm(x, nw, 1e-6), args.reps),
        jit_launch=host_us(lambda: fk._rms_norm_kernel[(1,)](*kargs, **kw), args.reps),
        compiled_launch=host_us(lambda: compiled[(1, 1, 1)](*all_args), args.reps),
    )
    print(json.dumps({k: round(v, 2) for k, v in rows.items()} | dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__)))


if __name__ == "__main__":
    main()
