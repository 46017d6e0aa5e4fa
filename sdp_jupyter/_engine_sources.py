"""Which files are the engine's sources, written once: setup.py (which loads this file by its path, the
package not being built yet) copies them into an installed package's SOURCES_DIR, and the SageMaker target
(launch/targets/sagemaker/source.py) ships them from a checkout or from that copy."""

SOURCES_DIR = "_sources"  #: the folder of an installed sdp_jupyter that holds native/ and SOURCES_TOP
NATIVE_FILES = (".h", ".hpp", ".cpp", ".cc", ".map")  #: native/'s files to ship (.map: the linker's export list)
SOURCES_TOP = ("pyproject.toml", "setup.py", "README.md")  #: beside native/ (pyproject names README.md)
