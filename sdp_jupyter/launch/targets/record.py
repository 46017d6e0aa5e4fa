"""What a target is to the rest of the package: a `Target` record (and the `FormField`s it adds to the
setup form). A leaf, imported by every target folder's __init__ and by the registry beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

from sdp_jupyter.launch.options import Option


@dataclass(frozen=True)
class FormField:
    """A field a target adds to the setup form (sdp_jupyter/jobsetup/model.py, ui/setup.py) and to %sdp_setup:
    `name` is the setup's field (and %sdp_setup's dest), `option` the %%sdp_train option row it mirrors
    (flag, help, metavar; its field "<JobSpec field>.<key>" says where a filled value goes), `label` and
    `placeholder` what the form shows. Empty: the key is left out of the spec (the target's default)."""

    name: str
    option: Option
    label: str
    placeholder: str = ""
    required: str | None = None  # the error while the target is chosen and the field is empty

    @property
    def key(self) -> str:
        """The key of the target's JobSpec dict field that the value fills ("ssh.hosts" -> "hosts")."""
        return self.option.field.split(".", 1)[1]

    def value(self, text: str):
        """The spec's value of what the form holds: a csv option a list of its items, else the text stripped."""
        text = str(text).strip()
        return [h.strip() for h in text.split(",") if h.strip()] if self.option.kind == "csv" else text


@dataclass(frozen=True)
class Target:
    """One target, everything the rest of the package asks of it. Every list of targets (the magic's and
    the CLI's --target, the setup form, the session check, the reference pages) is derived from the
    registry of these (sdp_jupyter/launch/targets/__init__.py)."""

    name: str
    launcher: str                 # "module:Class"; a module written ".launcher" is in the target's folder
    field: str | None = None      # the JobSpec dict field its own options fill ("ssh" -> JobSpec.ssh)
    options: str | None = None    # "module:ATTRIBUTE", a tuple of Option rows, loaded when the table is built
    keys: frozenset[str] | None = None  # the keys its JobSpec dict field takes (None: not checked here)
    form: tuple[FormField, ...] = ()  # the fields it adds to the setup form, shown while it is chosen
    plan_keys: tuple[str, ...] = ()  # setup (scaling.Plan) fields copied into its JobSpec dict field
    warm: bool = False            # --warm/--preload apply (ranks forked from a warm pool)
    exclusive: bool = False       # its options are refused with another --target
    nodes_from_hosts: bool = False  # --nodes left out: one node per host given (else 1 node)
    sessions: bool = False        # %sdp_session runs on it: ranks stay up between cells, a channel reaches them
    hybrid: bool = False          # the hybrid-parallel options (--tp, --pp, ...) reach its workers' environment
    this_machine: bool = False    # its nodes are this machine (the default target; its cores bound the ranks)
    own_hosts: bool = False       # its nodes are hosts you have (no instance type to pick); the job view names them
    catalogue: bool = False       # its nodes are instance types of the catalogue (sdp_jupyter.instances), priced
    elastic: bool = False         # --nodes MIN:MAX: a lost node is left out, a returning one rejoins (docs/failures.md)
    elastic_refusal: str | None = None  # why --nodes MIN:MAX is refused there (a target that is not elastic)
    heal: bool = False            # --heal: a dead rank's peers re-form without restarting (sdp_jupyter.heal)
