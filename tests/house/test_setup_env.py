"""setup.py reads its build switches (SDP_PORTABLE, SDP_BUILD_QUICK, SDP_SANITIZE, SDP_BUILD_JOBS) with
the package's one parser (sdp_jupyter/_env.py): `false` means off, empty means the default, and a bad
value stops the build with an error naming the variable. Nothing is compiled here."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from sdp_jupyter import _env

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = ("SDP_PORTABLE", "SDP_BUILD_QUICK", "SDP_SANITIZE")


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: its build_options(), without running setup() (that runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("sdp_setup_py", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def switched(opts: dict) -> set[str]:
    on = set()
    if ("SDP_NO_INTRINSICS", "1") in opts["macros"]:
        on.add("SDP_PORTABLE")
    if "-O0" in opts["compile_args"]:
        on.add("SDP_BUILD_QUICK")
    if "-fsanitize=address,undefined" in opts["compile_args"] and "-fsanitize=address,undefined" in opts["link_args"]:
        on.add("SDP_SANITIZE")
    return on


def test_setup_py_uses_the_package_parser_itself(setup_py):
    assert Path(setup_py._env.__file__).resolve() == Path(_env.__file__).resolve()


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "off", "", "  "])
def test_an_off_or_empty_value_leaves_the_switch_off(setup_py, name, value):
    opts = setup_py.build_options({name: value})
    assert switched(opts) == set()
    assert opts == setup_py.build_options({})


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["1", "true", "Yes", "ON"])
def test_an_on_value_turns_the_switch_on(setup_py, name, value):
    assert switched(setup_py.build_options({name: value})) == {name}


@pytest.mark.parametrize("name", SWITCHES)
def test_a_bad_value_is_an_error_naming_the_variable(setup_py, name):
    with pytest.raises(ValueError, match=f"{name}='maybe' is not a boolean"):
        setup_py.build_options({name: "maybe"})


def test_build_jobs_empty_is_the_default_and_a_bad_number_is_refused(setup_py):
    assert setup_py.build_options({"SDP_BUILD_JOBS": ""})["jobs"] == 0  # 0: one per CPU
    assert setup_py.build_options({"SDP_BUILD_JOBS": "3"})["jobs"] == 3
    with pytest.raises(ValueError, match="SDP_BUILD_JOBS='many' is not an integer"):
        setup_py.build_options({"SDP_BUILD_JOBS": "many"})


def test_running_setup_py_with_a_bad_value_stops_with_the_variable_named():
    env = {"PATH": "/usr/bin:/bin", "SDP_SANITIZE": "maybe"}
    r = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert "error: SDP_SANITIZE='maybe' is not a boolean" in r.stderr
