"""`python -m longserve.engine`: an engine-core process, started by the front end
(engine/core_client.py) with its arguments pickled on stdin. Its workers start first, before
this process imports torch, so that both import at once (worker/launch.py)."""
import os
import pickle
import sys
import traceback

code = 1
try:
    workers, config_bytes, rest = pickle.load(sys.stdin.buffer)  # plain types and bytes
    if workers is not None:
        from longserve.worker.launch import start_workers
        workers = start_workers(config_bytes, **workers)
    from longserve.engine.core_proc import run_engine_core
    run_engine_core(pickle.loads(config_bytes), *pickle.loads(rest), workers=workers)
    code = 0
except SystemExit as e:  # SIGTERM, or a failed start
    code = e.code if isinstance(e.code, int) else 1
except BaseException:
    traceback.print_exc()
finally:  # workers, sockets and the core are shut down: skip the interpreter's teardown
    sys.stdout.flush()  # (torch's finalizers take seconds on a busy host)
    sys.stderr.flush()
    os._exit(code)
