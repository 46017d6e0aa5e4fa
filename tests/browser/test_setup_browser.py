"""notebooks/02_job_setup.ipynb in JupyterLab and chromium: change the node count, see the global batch and
the LR hint change, press Launch, see the job succeed and its measured throughput reach the estimate."""
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

NOTEBOOK = "notebooks/02_job_setup.ipynb"


def test_job_setup_form_in_a_real_browser(lab):
    lab.open_notebook(NOTEBOOK)
    lab.run_all()
    form = lab.page.locator(".sdp-job-setup").first
    form.wait_for(timeout=60_000)
    global_batch = form.locator(".sdp-global-batch")
    lr = form.locator(".sdp-lr")
    # the notebook's preset: 1 node x 1 process x 32, LR 0.01 tuned at 32
    assert "global batch 32 =" in global_batch.inner_text()
    assert "learning rate 0.01 " in lr.inner_text()

    nodes = form.locator(".sdp-nodes input")
    nodes.fill("2")
    nodes.press("Enter")
    shown = lab.wait_text(global_batch, "global batch 64 =", what="global batch after nodes=2")
    assert "2 nodes x 1 GPUs x 32 per GPU" in shown
    # the LR line is its own widget: it may be drawn a moment after the global batch (read once, it raced)
    lab.wait_text(lr, r"learning rate 0\.02 \(linear rule: x2", what="learning rate after nodes=2")
    assert "--nodes 2" in form.locator(".sdp-magic-line").inner_text()
    lab.screenshot("job-setup-nodes-2")

    launch = form.locator(".sdp-launch")
    assert launch.is_enabled()
    launch.click()
    final = lab.wait_text(form.locator(".sdp-job-status"), "succeeded|failed|stopped", timeout=180,
                          what="the job's end")
    lab.screenshot("job-setup-succeeded")
    assert "succeeded" in final, final
    assert form.locator(".sdp-job-view").inner_text().strip(), "no job view below the form"

    # the job reported its samples: the form offers the measured throughput for the time estimate
    lab.wait_text(form.locator(".sdp-measured"), "samples/s per GPU", what="measured throughput")
    form.locator(".sdp-use-measured").click()
    lab.wait_text(form.locator(".sdp-hints"), r"time\s+[0-9.]+ (s|min|h) / epoch", what="time estimate")
    lab.screenshot("job-setup-measured")
