"""`python -m sdp_jupyter.doctor [--json] [--no-smoke]`: the report, exit status 1 when any line is FAIL."""
import sys

from sdp_jupyter.doctor import main

sys.exit(main())
