"""`dist.init_process_group("smddp")` works in a script that never imports sdp_jupyter."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.ranks import assert_all_ok, run_ranks


@pytest.mark.slow
def test_smddp_without_importing_sdp_jupyter():
    vals = assert_all_ok(run_ranks("engine_workers:init_without_import", 2, 1, timeout=180))
    for values, imported in vals:
        assert values == [3.0, 3.0, 3.0]
        assert imported  # the lazy creator brought the real backend in when the group was created


def test_autoload_off_gives_torchs_error_and_the_import_fixes_it():
    code = ("import torch.distributed as dist\n"
            "print('smddp' in dist.Backend.backend_list)\n"
            "import sdp_jupyter.torch\n"
            "print('smddp' in dist.Backend.backend_list)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
