"""The version is written in one place, sdp_jupyter/__init__.py's __version__: pyproject.toml reads it
(what pip, the wheel and `python setup.py --version` say), and CHANGELOG.md has a heading for it."""
from __future__ import annotations

import re
import tomllib

from conftest import REPO


def test_pyproject_takes_the_version_from_the_package():
    import sdp_jupyter

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sdp_jupyter.__version__"}
    from setuptools.config.pyprojecttoml import read_configuration

    assert read_configuration(REPO / "pyproject.toml", expand=True)["project"]["version"] == sdp_jupyter.__version__


def test_the_changelog_has_the_version():
    import sdp_jupyter

    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), flags=re.M)
    assert sdp_jupyter.__version__ in headings, f"CHANGELOG.md has no '## {sdp_jupyter.__version__}' heading"
