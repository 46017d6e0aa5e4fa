"""The job setup, without widgets: `JobSetup`, the model the setup form (sdp_jupyter/ui/setup.py) is a
view of (model.py: the fields, what they do through sdp_jupyter.scaling, the JobSpec Launch starts, cells
kept with %%sdp_cell), and %sdp_setup's options, one per field (setup_options.py).
"""
from sdp_jupyter.jobsetup.model import (CELLS, TEXT_NUMBERS, JobSetup, measured_throughput, setup_from_line,
                                        setup_from_options, store_cell)
from sdp_jupyter.jobsetup.setup_options import setup_arguments

__all__ = ["CELLS", "TEXT_NUMBERS", "JobSetup", "measured_throughput", "setup_arguments", "setup_from_line",
           "setup_from_options", "store_cell"]
