"""The identity case of test_batching.py (16 staggered requests on --slots 8
against each run alone on --slots 1: ids, text, finish and usage equal; the
batch really formed; reuse and memo on the batched server) with the routed
experts on two local expert servers (--workers 2): the whole batch's experts
go in one EXPERT_BATCH per worker per MoE layer. A file of its own to keep
each test short."""
import os
import runpy
import sys

os.environ["SHOAL_BATCHING_WORKERS"] = "1"
sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_batching.py")
runpy.run_path(sys.argv[0], run_name="__main__")
