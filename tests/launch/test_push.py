"""Notebook code by value (launch/kernel/push.py) and its binding on a rank (launch/rank/bootstrap.py):
pure logic, no processes. The kernel and SSH tests run the same through real jobs."""
from __future__ import annotations

import pickle
import socket
import threading
import types

import numpy as np
import pytest

from sdp_jupyter.launch.kernel.push import notebook_code, pickle_push
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.rank.bootstrap import bind_pushed

NOTEBOOK = '''
A = 5
def helper(x):
    return x + A
def uses_rank(x):
    return helper(x) * 2 + model      # `model` is the rank's own
class Net:
    k = 2
    def forward(self, x):
        return uses_rank(x) * self.k
    @staticmethod
    def const():
        return A
    @property
    def where(self):
        return model
def factory(w):
    def loss(x):
        return x * w + A
    return loss
loss = factory(3)
model = "the notebook's model"
'''


@pytest.fixture()
def notebook(monkeypatch):
    """A namespace whose functions and classes are of `__main__`, as a notebook's are."""
    main = types.ModuleType("__main__")
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    exec(compile(NOTEBOOK, "<notebook>", "exec"), main.__dict__)
    return main.__dict__


def _on_rank(data: bytes, ns: dict) -> dict:
    bind_pushed(pickle.loads(data), ns)
    return ns


def test_notebook_code_goes_by_value_and_reads_the_ranks_variables(notebook):
    call = (eval("lambda k: helper(k)", notebook), (1,), {})  # a notebook lambda, as run() and apply() send it
    data = pickle_push(["Net", "loss", "inst", "call"], {**notebook, "inst": notebook["Net"](), "call": call})
    ns = _on_rank(data, {"model": 7, "A": 1})  # a rank whose own A and model differ from the notebook's
    assert ns["Net"]().forward(1) == ((1 + 1) * 2 + 7) * 2  # the rank's A and model win over the notebook's
    assert ns["Net"].const() == 1 and ns["Net"]().where == 7 and ns["inst"].forward(1) == 22
    assert ns["loss"](2) == 2 * 3 + 1  # the closure keeps its cell (w = 3), reads the rank's A
    fn, args, _ = ns["call"]
    assert fn(*args) == 2  # a lambda inside a tuple (run's and apply's calls) is bound too
    assert ns["helper"](0) == 1  # a helper the pushed code reads came along, bound to the rank as well


def test_a_rank_without_the_notebook_globals_gets_them_from_the_push(notebook):
    ns = _on_rank(pickle_push(["Net"], notebook), {})
    assert ns["A"] == 5 and ns["model"] == "the notebook's model" and ns["helper"](1) == 6


def test_importable_objects_still_go_by_reference():
    data = pickle_push(["f", "a"], {"f": np.linalg.norm, "a": np.arange(3)})
    assert b"numpy" in data and len(data) < 600  # a reference to the module's function, not its code


@pytest.mark.parametrize("make, part, fix", [
    (lambda: {"cfg": {"lr": 0.1, "log": open(__file__)}}, "cfg['log'] is a TextIOWrapper",
     "push the file's path and open it on the ranks"),
    (lambda: {"cfg": [1, threading.Lock()]}, "cfg[1] is a lock", "make the lock on the ranks"),
    (lambda: {"cfg": socket.socket()}, "cannot be sent to the ranks", "open the connection on the ranks"),
    (lambda: {"cfg": (i for i in range(3))}, "cannot be sent to the ranks", "push a list of its items"),
])
def test_what_cannot_travel_is_named_with_the_part_and_the_fix(make, part, fix):
    values = make()
    with pytest.raises(SpecError) as e:
        pickle_push(["cfg"], values)
    text = str(e.value)
    assert text.startswith("--push: variable 'cfg'") and part in text and fix in text, text
    for v in values.values():
        getattr(v, "close", lambda: None)()


def test_a_function_reading_a_global_that_cannot_travel_names_that_global(notebook):
    notebook["lk"] = threading.Lock()
    exec("def guarded():\n    with lk:\n        return 1\n", notebook)
    with pytest.raises(SpecError, match=r"guarded \(global lk\) is a lock"):
        pickle_push(["guarded"], notebook)


def test_a_cuda_tensor_is_refused_with_the_fix():
    import torch

    class OnGPU(torch.Tensor):  # what the check reads of a CUDA tensor on a machine without one
        is_cuda = True
    t = torch.Tensor._make_subclass(OnGPU, torch.zeros(2))
    with pytest.raises(SpecError, match=r"push tensor.cpu\(\) and move it to the rank's device"):
        pickle_push(["t"], {"t": {"w": t}})
    assert pickle_push(["t"], {"t": torch.zeros(2)})  # a CPU tensor travels


def test_the_cell_names_the_notebook_code_it_uses(notebook):
    cell = ("import os\nm = Net()\nd = helper(3)\nprint(loss(2), A)\n"
            "def local():\n    return uses_rank\nfor model in range(2):\n    pass\n")
    # A and model are data (never sent unasked); local is the cell's own; uses_rank only inside a def
    assert notebook_code(cell, notebook, pushed=[]) == ["Net", "helper", "loss", "uses_rank"]
    assert notebook_code(cell, notebook, pushed=["Net"]) == ["helper", "loss", "uses_rank"]
    assert notebook_code("np.zeros(3)", {"np": np}, pushed=[]) == []  # a module's: importable on the ranks
    assert notebook_code("x = (", notebook, pushed=[]) == []  # a syntax error is the magic's to report


def test_a_result_holding_the_cells_own_class_comes_back_by_value(notebook, tmp_path):
    from sdp_jupyter import jobdir
    from sdp_jupyter.launch.rank.bootstrap import save_result

    tmp_path.chmod(0o700)
    assert save_result(str(tmp_path), {"model": notebook["Net"](), "loss": 0.5}, required=True) == 0
    data = (tmp_path / jobdir.RESULT).read_bytes()
    notebook.clear()  # the kernel has no such class: it comes with the result
    back = pickle.loads(data)
    assert back["loss"] == 0.5 and type(back["model"]).__name__ == "Net" and back["model"].k == 2
    assert save_result(str(tmp_path), [1, "plain"], required=True) == 0
    assert b"cloudpickle" not in (tmp_path / jobdir.RESULT).read_bytes()  # plain data stays plain pickle
