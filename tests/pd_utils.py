"""An engine (a producer, or a consumer) in its own process, driven over a pipe (engine-level
disaggregation tests)."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from unittest import mock

from longserve import LLM, SamplingParams

MODEL = "builtin:llama-tiny"
# LONGSERVE_TEST_PD_DEVICE=cuda runs these on GPUs over NCCL pair groups (float32): a producer
# process on LONGSERVE_TEST_PRODUCER_GPUS, the test's own engines on CUDA_VISIBLE_DEVICES
DEVICE = os.environ.get("LONGSERVE_TEST_PD_DEVICE", "cpu")
ENGINE = dict(device=DEVICE, dtype="float32", max_model_len=256)


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _producer_main(conn, kw):
    import torch
    torch.set_num_threads(1)
    llm = LLM(MODEL, **ENGINE, **kw)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            if conn.poll(0.005):
                cmd, arg = conn.recv()
                if cmd == "stop":
                    break
                conn.send(_handle(llm, cmd, arg))
    finally:
        llm.shutdown()


def _handle(llm, cmd, arg):
    if cmd == "prefill":
        out = llm.generate([arg], greedy(1), use_tqdm=False)[0]
        return out.kv_transfer_params
    if cmd == "pool":  # (free blocks, all blocks, held requests)
        kv = llm.engine.core.kv
        return kv.num_free_blocks, kv.num_blocks, len(llm.engine.core.scheduler.held)
    if cmd == "groups":  # pair groups rank 0 built so far
        return llm.engine.core.executor.driver.runner.kv_connector.groups.num_created
    if cmd == "generate":  # as a consumer: (prompt, kv_transfer_params, max_tokens)
        prompt, params, n = arg
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                            extra_args={"kv_transfer_params": params})
        return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    raise ValueError(cmd)


class Producer:
    """An engine in a child process (a producer by default: on the producer GPUs under cuda;
    `beside_test=True` puts it on the test's own GPUs, as a second consumer)."""
    def __init__(self, timeout=120, beside_test=False, **kw):
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_producer_main, args=(child, kw))  # not a daemon: it spawns its own workers
        gpus = os.environ.get("LONGSERVE_TEST_PRODUCER_GPUS")
        env = {"CUDA_VISIBLE_DEVICES": gpus} if DEVICE == "cuda" and not beside_test else {}
        with mock.patch.dict(os.environ, env):
            self.proc.start()  # the child inherits the environment as it is now
        self.timeout = timeout
        tag, self.pid = self._recv()
        assert tag == "ready"

    def _recv(self):
        deadline = time.monotonic() + self.timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError("the engine process did not answer")
        try:
            return self.conn.recv()
        except EOFError:  # it died: its end of the pipe closed
            self.proc.join(10)
            raise RuntimeError(f"the engine process died (exit code {self.proc.exitcode})") from None

    def call(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        return self._recv()

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
