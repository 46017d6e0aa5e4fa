"""A collective is its record (native/src/coll_records.cpp): its code and name, what it agrees on, what
the engine covers by layout, what a group of one rank does and its algorithm. Nothing else in the
engine names a collective, and Python reads the codes by name from the binding: a new record is in
`comm.COLLS` and `comm.COLLECTIVES` with no edit (docs/architecture.md, "Adding a collective")."""
from __future__ import annotations

import re
from pathlib import Path

from sdp_jupyter import _engine, comm

ROOT = Path(__file__).resolve().parents[2]


def test_python_reads_every_record_from_the_binding():
    records = _engine.collectives()
    assert [r["name"] for r in records] == list(comm.COLLECTIVES) == list(comm.COLLS)
    codes = [r["code"] for r in records]
    assert len(set(codes)) == len(codes) and codes == sorted(codes), codes  # codes unique, in record order
    assert {name: int(v) for name, v in _engine.Coll.__members__.items()} == comm.COLLS
    assert comm.COLLS["barrier"] == 8 and comm.COLLS["all_reduce"] == 1  # codes travel in frames: never renumbered


def _engine_sources():
    return {p.relative_to(ROOT).as_posix(): p.read_text()
            for p in sorted((ROOT / "native").rglob("*")) if p.suffix in (".cpp", ".h")}


def test_no_file_but_the_records_names_a_collective():
    named = {path: sorted(set(re.findall(r"\bColl::[A-Z_]+", text))) for path, text in _engine_sources().items()}
    assert not {p: n for p, n in named.items() if n}, "a collective named outside its record"
    enum = re.search(r"enum class Coll : uint8_t \{([^}]*)\};", _engine_sources()["native/include/sdp/common.h"])
    assert enum and enum.group(1).strip() == "", "common.h's Coll lists no collective: the records give the codes"
    constants = [f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "sdp_jupyter").rglob("*.py")
                 for m in re.findall(r"^(COLL_[A-Z_]+) *=", p.read_text(), re.M) if m != "COLL_TAG"]
    assert not constants, f"a hand-written collective code: {constants}"


def test_the_checks_can_fail():
    text = "if (w.coll == Coll::GATHER) copy();"
    assert re.findall(r"\bColl::[A-Z_]+", text) == ["Coll::GATHER"]
    assert re.findall(r"^(COLL_[A-Z_]+) *=", "COLL_BARRIER = COLLS['barrier']\nCOLL_TAG = 1\n", re.M) == [
        "COLL_BARRIER", "COLL_TAG"]
