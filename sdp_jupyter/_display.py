"""How a model (a Job, a JobSetup) shows itself in IPython: its widget in a Jupyter kernel, its
text summary in a terminal. Imports no widgets; the model's own ``view()`` does, when called."""
from __future__ import annotations


def widgets_enabled() -> bool:
    """True inside a Jupyter kernel (a frontend can render widgets); False in a terminal IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class Shown:
    """Mixin for a model with ``view()`` (its widget) and ``summary()`` (its text)."""

    def _repr_pretty_(self, p, cycle):
        p.text(self.summary())

    def _ipython_display_(self):
        from IPython.display import display

        if widgets_enabled():
            display(self.view())
        else:
            print(self.summary())
