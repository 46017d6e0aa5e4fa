"""Notebook code reaches the ranks (issue 62 items 1-3), in a real ipykernel as a person uses it.

One kernel for the module. Earlier cells define a model class whose forward reads a notebook global,
a data function and a closure made by a factory; a 2-node %%sdp_train cell that uses them (without
listing them: they go by value without being asked) trains 5 SGD steps and must end with the weights
the same code gives in the kernel on both ranks' data at once. `sdp_jupyter.run(f, ...)` returns every
rank's value of a notebook function; a session object pushes, executes, pulls and applies notebook code.
"""
from __future__ import annotations

import pytest

from helpers.kernel import execute, sdp_kernel

pytestmark = pytest.mark.slow

DEFINE = '''
import torch
SCALE = 0.5                      # read by Net.forward: a notebook global
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)
    def forward(self, x):
        return self.fc(x) * SCALE
def make_data(rank, world):      # each rank's half of one fixed batch
    g = torch.Generator().manual_seed(7)
    X, Y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    return X[rank::world], Y[rank::world]
def loss_factory(weight):
    def loss(pred, y):           # a closure: `weight` lives in its cell
        return weight * torch.nn.functional.mse_loss(pred, y)
    return loss
loss_fn = loss_factory(2.0)
'''

TRAIN = '''%%sdp_train --nodes 2 --backend gloo --init-process-group --wait --result trained
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, Y = make_data(dist.get_rank(), dist.get_world_size())
for _ in range(5):
    opt.zero_grad()
    loss_fn(model(X), Y).backward()
    opt.step()
[p.detach().clone() for p in model.module.parameters()]
'''

# the same steps in the kernel: DDP averages the two halves' gradients, which for equal halves and a
# mean loss is the gradient of the mean over both halves
REFERENCE = '''
ref = Net()
opt = torch.optim.SGD(ref.parameters(), lr=0.1)
halves = [make_data(r, 2) for r in range(2)]
for _ in range(5):
    opt.zero_grad()
    sum(loss_fn(ref(x), y) for x, y in halves).div(2).backward()
    opt.step()
print("max diff", max((a - b).abs().max().item() for a, b in zip(trained, ref.parameters())))
'''


def _ok(kc, code, timeout=180):
    reply, messages = execute(kc, code, timeout=timeout)
    text = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    assert reply["status"] == "ok", (reply.get("evalue"), "\n".join(reply.get("traceback") or []), text)
    return text


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with sdp_kernel(tmp_path_factory.mktemp("notebook-code-jobs")) as (_, kc):
        _ok(kc, "import sdp_jupyter\n" + DEFINE)
        yield kc


def test_notebook_class_function_and_closure_train_to_the_kernels_weights(kernel):
    out = _ok(kernel, TRAIN)
    assert "sending Net, loss_fn, make_data from the notebook by value" in out, out
    out = _ok(kernel, REFERENCE)
    diff = float(out.split("max diff")[1].split()[0])
    assert diff < 1e-4, out


def test_without_auto_push_the_cell_names_what_is_missing(kernel):
    reply, messages = execute(kernel, "%%sdp_train --nodes 1 --backend gloo --wait --no-auto-push\nNet()\n",
                              timeout=120)
    assert reply["status"] == "error"
    text = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
    assert "NameError: name 'Net' is not defined" in text + reply.get("evalue", ""), text


def test_what_cannot_travel_is_refused_before_launch(kernel):
    _ok(kernel, "import threading\nstate = {'lr': 0.1, 'lock': threading.Lock()}")
    reply, _ = execute(kernel, "%%sdp_train --nodes 1 --push state\npass\n", timeout=60)
    assert reply["status"] == "error"
    assert "state['lock'] is a lock" in reply["evalue"] and "Fix: make the lock on the ranks" in reply["evalue"]
    assert "Nothing was launched" in reply["evalue"]


def test_run_returns_every_ranks_value_of_a_notebook_function(kernel):
    _ok(kernel, "BASE = 1000\n"
                "def f(n, scale=1):\n"
                "    import os, torch.distributed as dist\n"
                "    return (int(os.environ['RANK']), dist.get_world_size(), BASE + n * scale)\n")
    out = _ok(kernel, "values = sdp_jupyter.run(f, args=(10,), kwargs={'scale': 2}, nodes=2, backend='gloo')\n"
                      "print('values', values)")
    assert "values [(0, 2, 1020), (1, 2, 1020)]" in out, out


def test_a_session_object_pushes_executes_pulls_and_applies(kernel):
    out = _ok(kernel, '''
def shifted(x):
    return x + OFFSET + rank_base      # OFFSET from the notebook, rank_base from the rank
OFFSET = 5
with sdp_jupyter.session(nodes=2, backend="gloo") as s:
    s.push(shifted=shifted)
    s.execute("import torch.distributed as dist\\nrank_base = 100 * dist.get_rank()\\ny = shifted(1)")
    print("pulled", s.pull("y"))
    print("applied", s.apply(lambda k: shifted(k) * 2, 10))
    state = s.job.state
print("state", state, s.job.state)
''', timeout=240)
    assert "pulled [6, 106]" in out and "applied [30, 230]" in out, out
    assert "state running succeeded" in out, out  # a session stopped as asked ends as a job that succeeded
