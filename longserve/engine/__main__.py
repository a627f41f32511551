"""`python -m longserve.engine`: an engine-core process spawned by the front end (core_launch.py)
with its arguments pickled on stdin (no re-import of the caller's script)."""
import os
import pickle
import sys
import traceback

code = 1
try:
    from longserve.engine.core_launch import core_main
    code = core_main(*pickle.load(sys.stdin.buffer))  # plain types and bytes
except BaseException:
    traceback.print_exc()
finally:  # workers, sockets and the core are shut down: skip the interpreter's teardown
    sys.stdout.flush()  # (torch's finalizers take seconds on a busy host)
    sys.stderr.flush()
    os._exit(code)
