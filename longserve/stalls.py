"""First-minute stalls: `freeze_after_warm_up()` gc-freezes start-up's objects; then slow GC passes,
Triton compiles and event-loop lag are logged (docs/architecture.md, 'Warm and frozen')."""
from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import os
import time

logger = logging.getLogger("longserve.stalls")
GC_PAUSE_S = 0.05
LOOP_LAG_S = 0.1
FAIL_ON_COMPILE = "LONGSERVE_FAIL_ON_COMPILE"
_gc_started: list[float] = []


def freeze_after_warm_up() -> None:
    gc.collect()
    gc.freeze()
    if _log_gc_pause not in gc.callbacks:
        gc.callbacks.append(_log_gc_pause)
        atexit.register(_thaw)
        _watch_kernel_compiles()


def _watch_kernel_compiles() -> None:
    """Triton's JIT hooks, if any: before a variant compiles or loads from disk, and after."""
    try:
        from triton import knobs
    except ImportError:
        return
    started: dict = {}

    def before(key=None, **_):
        started[str(key)] = time.perf_counter()  # None: Triton goes on and compiles

    def after(key=None, repr=None, compile=None, **_):
        took = time.perf_counter() - started.pop(str(key), time.perf_counter())
        c = compile or {}
        what = (f"process {os.getpid()}: a Triton kernel was compiled while serving "
                f"({1e3 * took:.0f} ms): {(repr or '?').split('(')[0]} "
                f"{_variant(c.get('signature'), c.get('constants'), c.get('configs'))}")
        if os.environ.get(FAIL_ON_COMPILE) == "1":  # benchmarks: a compile after ready fails the run
            raise RuntimeError(what)
        logger.warning(what)
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after


def _variant(signature, constants, configs) -> str:
    """What picked a variant, by argument name: its pointers' element types, its constants
    (constexprs, and ints equal to 1) and the arguments it assumed divisible by 16."""
    try:
        names = list(signature)
        pointers = [f"{n} {t}" for n, t in signature.items() if str(t).startswith("*")]
        consts = [f"{names[k[0]]}={v}" for k, v in constants.items()]
        div16 = [names[k[0]] for k, attrs in (configs or [{}])[0].items()
                 if ["tt.divisibility", 16] in [list(a) for a in attrs]]
        return (f"pointers {', '.join(pointers)}; constants {', '.join(consts)}; "
                f"divisible by 16: {', '.join(div16)}")[:1000]
    except Exception as e:  # another Triton's hook arguments: the stall is still logged
        return f"(variant not read: {type(e).__name__})"


def _thaw() -> None:
    """At exit: the interpreter's last collections free everything (no leak reports)."""
    gc.callbacks.remove(_log_gc_pause)
    gc.unfreeze()


def _log_gc_pause(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started and (pause := time.perf_counter() - _gc_started.pop()) > GC_PAUSE_S:
        logger.warning("process %d: a generation-%d garbage collection paused it %.0f ms",
                       os.getpid(), info["generation"], 1e3 * pause)


async def watch_loop_lag(period: float = 0.1) -> None:
    """Log every wake-up of this event loop over LOOP_LAG_S late (a callback held it: streams stalled)."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period)
        lag = loop.time() - t - period
        if lag > LOOP_LAG_S:
            logger.warning("process %d: the event loop ran %.0f ms late", os.getpid(), 1e3 * lag)
