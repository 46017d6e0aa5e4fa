"""smdistributed.dataparallel served by sdp_jupyter (not SageMaker's library)."""
__version__ = "sdp_jupyter-compat"
SDP_JUPYTER_COMPAT = True
