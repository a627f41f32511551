"""`python -m longserve.engine`: an engine-core process, started by the front end
(engine/core_client.py) with its arguments pickled on stdin."""
import pickle
import sys

from longserve.engine.core_proc import run_engine_core

run_engine_core(*pickle.load(sys.stdin.buffer))
