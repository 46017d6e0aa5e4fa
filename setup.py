"""Builds the native AllReduce engine (native/) as the extension sdp_jupyter._engine.

The engine never includes torch headers: it works on raw buffers, so it compiles in seconds
and does not tie the wheel to one torch version.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "sdp_jupyter._engine",
    sorted(glob.glob("native/src/*.cpp")) + ["native/python/module.cpp"],
    include_dirs=["native/include"],
    cxx_std=17,
    extra_compile_args=["-O3", "-pthread", "-fno-strict-aliasing"],
    extra_link_args=["-pthread", "-lrt"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
