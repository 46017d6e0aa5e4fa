"""notebooks/02_job_setup.ipynb in JupyterLab and chromium: change the node count, see the global batch and
the LR hint change, press Launch, see the job succeed."""
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

NOTEBOOK = "notebooks/02_job_setup.ipynb"


def test_job_setup_form_in_a_real_browser(lab):
    page = lab.page
    lab.open_notebook(NOTEBOOK)
    lab.run_all()
    form = page.locator(".sdp-job-setup").first
    form.wait_for(timeout=60_000)
    global_batch = form.locator(".sdp-global-batch")
    lr = form.locator(".sdp-lr")
    # the notebook's preset: 1 node x 1 process x 32, LR 0.01 tuned at 32
    assert "global batch 32 =" in global_batch.inner_text()
    assert "learning rate 0.01 " in lr.inner_text()

    nodes = form.locator(".sdp-nodes input")
    nodes.fill("2")
    nodes.press("Enter")
    try:
        page.wait_for_function(
            "el => el.innerText.includes('global batch 64 =')", arg=global_batch.element_handle(), timeout=30_000)
    except Exception:
        lab.fail(f"global batch did not change after nodes=2: {global_batch.inner_text()!r}")
    assert "2 nodes x 1 GPUs x 32 per GPU" in global_batch.inner_text()
    assert re.search(r"learning rate 0\.02 \(linear rule: x2", lr.inner_text()), lr.inner_text()
    assert "--nodes 2" in form.locator(".sdp-magic-line").inner_text()
    lab.screenshot("job-setup-nodes-2")

    launch = form.locator(".sdp-launch")
    assert launch.is_enabled()
    launch.click()
    status = form.locator(".sdp-job-status")
    try:
        page.wait_for_function("el => /succeeded|failed|stopped/.test(el.innerText)",
                               arg=status.element_handle(), timeout=180_000)
    except Exception:
        lab.fail(f"the job did not end within 180 s: {status.inner_text()!r}")
    final = status.inner_text()
    lab.screenshot("job-setup-succeeded")
    assert "succeeded" in final, final
    assert form.locator(".sdp-job-view").inner_text().strip(), "no job view below the form"

    # the job reported its samples: the form offers the measured throughput for the time estimate
    measured = form.locator(".sdp-measured")
    try:
        page.wait_for_function("el => el.innerText.includes('samples/s per GPU')",
                               arg=measured.element_handle(), timeout=30_000)
    except Exception:
        lab.fail(f"no measured throughput after the job: {measured.inner_text()!r}")
    form.locator(".sdp-use-measured").click()
    hints = form.locator(".sdp-hints")
    try:
        page.wait_for_function(r"el => /time\s+[0-9.]+ (s|min|h) \/ epoch/.test(el.innerText)",
                               arg=hints.element_handle(), timeout=30_000)
    except Exception:
        lab.fail(f"the estimate did not use the measured throughput: {hints.inner_text()!r}")
    lab.screenshot("job-setup-measured")
