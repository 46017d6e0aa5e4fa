"""Entry point of one rank in engine tests: `python tests/helpers/rank_entry.py module:function result.pkl`.

Runs the function with the pickled args from SDP_TEST_ARGS (a file), stores its return value or
the error text in result.pkl, and exits non-zero on error.
"""
import os
import pickle
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/helpers: the *_workers modules

target, result_path = sys.argv[1], sys.argv[2]
module_name, func_name = target.split(":")
with open(os.environ["SDP_TEST_ARGS"], "rb") as f:
    args = pickle.load(f)
if os.environ.get("SDP_TEST_DUMP_AFTER"):  # see helpers.ranks.run_ranks
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["SDP_TEST_DUMP_AFTER"]), exit=False)
try:
    module = __import__(module_name)
    value = getattr(module, func_name)(*args)
    out = {"ok": True, "value": value}
    code = 0
except BaseException as exc:  # noqa: BLE001 - the test asserts on whatever happened
    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    code = 1
with open(result_path, "wb") as f:
    pickle.dump(out, f)
sys.stdout.flush()
os._exit(code)
