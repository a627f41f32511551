"""`python -m longserve.engine`: an engine-core process, started by the front end
(engine/core_client.py) with its arguments pickled on stdin."""
import os
import pickle
import sys
import traceback

from longserve.engine.core_proc import run_engine_core

code = 1
try:
    run_engine_core(*pickle.load(sys.stdin.buffer))
    code = 0
except SystemExit as e:  # SIGTERM, or a failed start
    code = e.code if isinstance(e.code, int) else 1
except BaseException:
    traceback.print_exc()
finally:  # workers, sockets and the core are shut down: skip the interpreter's teardown
    sys.stdout.flush()  # (torch's finalizers take seconds on a busy host)
    sys.stderr.flush()
    os._exit(code)
