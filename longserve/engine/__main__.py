"""`python -m longserve.engine`: an engine-core process spawned by the front end (core_launch.py)
with its arguments pickled on stdin (no re-import of the caller's script)."""
import os
import pickle
import sys

from longserve.engine.core_launch import core_main

# core_main reports any failure and flushes: skip the interpreter's teardown (torch's finalizers
# take seconds on a busy host)
os._exit(core_main(*pickle.load(sys.stdin.buffer)))  # plain types and bytes
