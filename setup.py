"""Builds the native AllReduce engine (native/) as the extension sdp_jupyter._engine.

The engine never includes torch headers: it works on raw buffers, so it compiles in seconds
and does not tie the wheel to one torch version.

Build switches (environment variables at build time):
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
"""
import glob
import importlib.util
import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

compile_args = ["-O3", "-pthread", "-fno-strict-aliasing"]
link_args = ["-pthread", "-lrt", "-Wl,--version-script=native/exports.map", "-Wl,--exclude-libs,ALL"]
macros = []
if os.environ.get("SDP_PORTABLE", "") not in ("", "0"):
    macros.append(("SDP_NO_INTRINSICS", "1"))
if os.environ.get("SDP_BUILD_QUICK", "") not in ("", "0"):
    compile_args = ["-O0", "-pthread", "-fno-strict-aliasing"]
if os.environ.get("SDP_SANITIZE", "") not in ("", "0"):
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    compile_args = ["-O1", "-g", "-pthread", "-fno-strict-aliasing"] + san
    link_args = link_args + san

ext = Pybind11Extension(
    "sdp_jupyter._engine",
    sorted(glob.glob("native/src/*.cpp")) + ["native/python/module.cpp"],
    include_dirs=["native/include"],
    cxx_std=17,
    define_macros=macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)



def _native_check():
    spec = importlib.util.spec_from_file_location("_native_check", os.path.join("sdp_jupyter", "_native_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


class checked_build_ext(build_ext):
    """build_ext, then the check that the engine keeps any C++ runtime copy to itself."""

    def build_extension(self, ext):
        super().build_extension(ext)
        report = _native_check().inspect(self.get_ext_fullpath(ext.name))
        problem = report.problem()
        if problem:
            raise SystemExit("error: " + problem)
        print(f"[sdp_jupyter] engine built: {report.summary()}")


ParallelCompile("SDP_BUILD_JOBS", default=0).install()
setup(ext_modules=[ext], cmdclass={"build_ext": checked_build_ext})
