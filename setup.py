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
"""
import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

compile_args = ["-O3", "-pthread", "-fno-strict-aliasing"]
link_args = ["-pthread", "-lrt"]
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

ParallelCompile("SDP_BUILD_JOBS", default=0).install()
setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
