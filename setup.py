"""Builds the native AllReduce engine (native/) as the extension sdp_jupyter._engine.

The engine never includes torch headers: it works on raw buffers, so it compiles in seconds
and does not tie the wheel to one torch version.

Build switches (environment variables at build time; the on/off ones take 1/0, true/false, yes/no
or on/off, unset or empty is off, and anything else stops the build with an error naming the
variable: sdp_jupyter/_env.py, the package's own parser, read here by its path):
  SDP_PORTABLE=1   no intrinsics at all (no AVX2/F16C kernels, no pause instruction): the build for
                   any CPU, and the check that the portable kernels alone are right.
  SDP_BUILD_QUICK=1  -O0: builds in about a third of the time, runs slower; for checks that the engine
                   builds and works (a SageMaker rehearsal's hosts use it), never for speed.
  SDP_BUILD_JOBS=N compile N files at once (default: one per CPU).
  SDP_SANITIZE=1   AddressSanitizer + UndefinedBehaviorSanitizer (-O1, frame pointers): the test
                   suite builds this once into a separate folder and runs the engine tests under it.
CC/CXX/LDFLAGS work as for any setuptools build (tools/build_matrix.py builds with clang and with
LDFLAGS=-static-libstdc++).

Whatever the toolchain, the object exports only PyInit__engine (native/exports.map, and
--exclude-libs,ALL for a C++ runtime linked in statically), and the build is checked right after
linking: an object that would export std:: symbols into a process beside torch's libstdc++ fails
the build with the cause and the fix (sdp_jupyter/_native_check.py).

The engine's sources travel in the package too: build_py copies native/ (the NATIVE_FILES), setup.py,
pyproject.toml and README.md into sdp_jupyter/_sources/ of the build (never of the checkout), so an
installed wheel can write the source package that --engine sdp ships to SageMaker
(sdp_jupyter/launch/targets/sagemaker/source.py). An editable install reads them from the checkout.
"""
import glob
import importlib.util
import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    """sdp_jupyter/<name>.py, loaded by its path: the package cannot be imported before it is built."""
    spec = importlib.util.spec_from_file_location(f"_sdp_build{name}", os.path.join(HERE, "sdp_jupyter", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


# Where an installed sdp_jupyter keeps its engine's sources, and which (one list, shared with the SageMaker target)
_sources = _load("_engine_sources")
SOURCES_DIR, NATIVE_FILES, SOURCES_TOP = _sources.SOURCES_DIR, _sources.NATIVE_FILES, _sources.SOURCES_TOP

_env = _load("_env")  # the package's one parser: 1/0, true/false, yes/no, on/off; empty = the default


def build_options(environ=None):
    """The build switches read from `environ` (default: os.environ) with the package's parser, as
    {macros, compile_args, link_args, jobs}; a bad value raises ValueError naming the variable."""
    compile_args = ["-O3", "-pthread", "-fno-strict-aliasing"]
    link_args = ["-pthread", "-lrt", "-Wl,--version-script=native/exports.map", "-Wl,--exclude-libs,ALL"]
    macros = []
    if _env.env_bool("SDP_PORTABLE", False, environ=environ):
        macros.append(("SDP_NO_INTRINSICS", "1"))
    if _env.env_bool("SDP_BUILD_QUICK", False, environ=environ):
        compile_args = ["-O0", "-pthread", "-fno-strict-aliasing"]
    if _env.env_bool("SDP_SANITIZE", False, environ=environ):
        san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
        compile_args = ["-O1", "-g", "-pthread", "-fno-strict-aliasing"] + san
        link_args = link_args + san
    jobs = _env.env_int("SDP_BUILD_JOBS", 0, min=0, environ=environ)  # 0: one per CPU
    return {"macros": macros, "compile_args": compile_args, "link_args": link_args, "jobs": jobs}


class checked_build_ext(build_ext):
    """build_ext, then the check that the engine keeps any C++ runtime copy to itself."""

    def build_extension(self, ext):
        super().build_extension(ext)
        report = _load("_native_check").inspect(self.get_ext_fullpath(ext.name))
        problem = report.problem()
        if problem:
            raise SystemExit("error: " + problem)
        print(f"[sdp_jupyter] engine built: {report.summary()}")


class build_py_with_sources(build_py):
    """build_py, then the engine's sources copied into sdp_jupyter/_sources/ of the build folder
    (the wheel's contents); skipped for an editable install, which has the checkout."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        native = [os.path.relpath(os.path.join(folder, n), HERE)
                  for folder, _, names in os.walk(os.path.join(HERE, "native"))
                  for n in names if n.endswith(NATIVE_FILES)]
        for rel in sorted(native) + [n for n in SOURCES_TOP if os.path.isfile(os.path.join(HERE, n))]:
            dest = os.path.join(self.build_lib, "sdp_jupyter", SOURCES_DIR, rel)
            self.mkpath(os.path.dirname(dest))
            self.copy_file(os.path.join(HERE, rel), dest, preserve_mode=False)


def main():
    try:
        opts = build_options()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    ext = Pybind11Extension(
        "sdp_jupyter._engine",
        sorted(glob.glob("native/src/*.cpp")) + ["native/python/module.cpp"],
        include_dirs=["native/include"],
        cxx_std=17,
        define_macros=opts["macros"],
        extra_compile_args=opts["compile_args"],
        extra_link_args=opts["link_args"],
    )
    ParallelCompile(default=opts["jobs"]).install()
    setup(ext_modules=[ext], cmdclass={"build_ext": checked_build_ext, "build_py": build_py_with_sources})


if __name__ == "__main__":  # pip's and setuptools' build backends run this file as __main__ too
    main()
