"""What the engine's shared object links and exports, read from its ELF file (no binutils needed).

Why it matters: a toolchain that links the C++ runtime statically into a shared object (a GCC in
its own prefix, RHEL's gcc-toolset, several HPC and CUDA images) gives the engine its own copy of
libstdc++. If that copy's symbols are exported, a process that also loaded the system
`libstdc++.so.6` (torch does) binds some calls to one copy and some to the other, and the two
disagree (seen: SIGSEGV at address 0 in locale code at the first collective). The engine is built
to export nothing but its module init (setup.py: a version script and --exclude-libs), and this
module is how setup.py, `python -m sdp_jupyter.doctor` and the tests check that it does.

Standard library only, and no import of the package: setup.py loads this file by path before the
package is built.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field

# Itanium-mangled names in namespace std: std::x (_ZSt, _ZNSt, _ZNKSt), the abbreviations for
# std::string/istream/ostream/iostream/allocator/basic_string (Ss Si So Sd Sa Sb), and the
# vtables, typeinfo, guard variables and local statics built from them.
_STD = re.compile(r"^_Z(?:T[VISHWT]|G[VR]|Z)?N?K?S[tsiodab]")
MODULE_INIT = re.compile(r"^PyInit_")


@dataclass
class NativeReport:
    path: str
    needed: list[str] = field(default_factory=list)  # DT_NEEDED: the shared libraries it loads
    exported: list[str] = field(default_factory=list)  # defined, globally visible dynamic symbols

    @property
    def cxx_runtime_dynamic(self) -> bool:
        """True when the C++ runtime comes from the system's libstdc++.so (or libc++.so)."""
        return any(n.startswith(("libstdc++.so", "libc++.so")) for n in self.needed)

    @property
    def exported_std(self) -> list[str]:
        return [s for s in self.exported if _STD.match(s)]

    @property
    def exported_other(self) -> list[str]:
        """Exported symbols beyond the module init (the version script allows nothing else)."""
        return [s for s in self.exported if not MODULE_INIT.match(s)]

    def problem(self) -> str | None:
        """None when the object is safe beside any other C++ runtime; else what is wrong and the fix."""
        if not self.exported_std:
            return None
        how = "a copy of the C++ runtime linked in statically" if not self.cxx_runtime_dynamic else \
            "C++ standard library symbols"
        return (f"{self.path} exports {len(self.exported_std)} std:: symbols ({how}; e.g. "
                f"{self.exported_std[0]}). In a process that also loads the system libstdc++.so.6 (torch does) "
                "the two copies get mixed and the first collective can crash (SIGSEGV in locale code). "
                "Fix: build with a linker that honours the version script native/exports.map (GNU ld, gold, lld), "
                "or with the distribution's g++ (CC=gcc CXX=g++ pip install ...), whose runtime is shared")

    def summary(self) -> str:
        runtime = "shared libstdc++" if self.cxx_runtime_dynamic else "static C++ runtime kept private"
        return f"{runtime}, {len(self.exported)} exported symbol(s), {len(self.exported_std)} of them std::"


def inspect(path: str) -> NativeReport:
    """Reads DT_NEEDED and the defined global/weak dynamic symbols of a 64-bit little-endian ELF."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    report = NativeReport(path)

    def strtab(index: int):
        off = sections[index][4]
        return lambda o: data[off + o:data.index(b"\0", off + o)].decode("utf-8", "replace")

    for sh in sections:
        kind, offset, size, link, entsize = sh[1], sh[4], sh[5], sh[6], sh[9]
        if kind == 6:  # SHT_DYNAMIC
            name = strtab(link)
            for i in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, offset + i)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    report.needed.append(name(val))
        elif kind == 11:  # SHT_DYNSYM
            name = strtab(link)
            for i in range(entsize, size, entsize):  # entry 0 is the null symbol
                st_name, st_info, st_other, st_shndx = struct.unpack_from("<IBBH", data, offset + i)
                bind, visibility = st_info >> 4, st_other & 3
                if st_shndx != 0 and bind in (1, 2, 10) and visibility in (0, 3):  # defined GLOBAL/WEAK/UNIQUE
                    report.exported.append(name(st_name))
    return report


def engine_path() -> str:
    """The built engine of the installed package (imports nothing of it)."""
    import importlib.util

    spec = importlib.util.find_spec("sdp_jupyter._engine")
    if spec is None or not spec.origin:
        raise FileNotFoundError("sdp_jupyter._engine is not built: pip install -e . compiles it")
    return spec.origin
