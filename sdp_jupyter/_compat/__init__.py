"""Compatibility packages the local launcher puts on a job's PYTHONPATH (see README.md).

This folder is shipped inside sdp_jupyter (so a wheel carries it) but is never importable as a
top-level `smdistributed` unless the launcher adds this folder to a job's path, which it does only
when the real library is absent.
"""
