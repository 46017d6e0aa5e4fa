"""The engine built four ways (default compiler, Debian's clang, g++ with the C++ runtime linked in
statically, the portable build), each checked three ways: what its shared object exports, the
engine's tests, and a 2-rank torch run in which every rank imports torch (and so the system
libstdc++.so.6) before anything of sdp_jupyter (issue 33).

    .venv/bin/python tools/build_matrix.py [--fast] [--only NAME,...] [--json PATH]

Exit status 1 when a row that ran failed; a row whose compiler is missing is skipped, not passed.
tests/engine/test_native_builds.py runs the same functions.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))  # helpers.native_builds, helpers.ranks (import nothing of sdp_jupyter)


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict
    needs: tuple = ()  # executables the build needs beyond the default toolchain
    fix: str = ""  # how to get them
    deselect: tuple = ()  # node ids (tests/...) of engine tests that do not apply to this build

    @property
    def folder(self) -> str:  # build/variants/<folder>
        return "matrix-" + self.name


VARIANTS = {v.name: v for v in [
    Variant("default", {}),
    Variant("clang", {"CC": "clang", "CXX": "clang++"}, ("clang", "clang++"), "apt-get install clang"),
    Variant("static-runtime", {"CC": "gcc", "CXX": "g++", "LDFLAGS": "-static-libstdc++"}, ("gcc", "g++"),
            "apt-get install g++"),
    # a portable engine has no SIMD kernels and never reads SDP_NO_SIMD, so it refuses no value of it
    Variant("portable", {"SDP_PORTABLE": "1"},
            deselect=("tests/engine/test_engine.py::test_no_simd_reads_booleans_as_python_does[maybe-error]",)),
]}

# --fast: every collective (all_reduce in every op and dtype, broadcast, reduce, all_gather,
# reduce_scatter, send/recv ring, barrier, gather, scatter, all_to_all) on the shared-memory and
# the TCP path, the kernels in every dtype, and mismatch errors (count, dtype, gather/scatter).
FAST_ENGINE_TESTS = [
    "engine/test_engine.py::test_hmac_matches_python",
    "engine/test_engine.py::test_kernels_match_numpy",
    "engine/test_engine.py::test_bf16_conversion_rounds_to_nearest_even",
    "engine/test_engine.py::test_every_collective_matches_numpy[2-2]",
    "engine/test_engine.py::test_every_collective_matches_numpy[2-1]",
    "engine/test_engine.py::test_every_collective_matches_numpy[3-1]",
    "engine/test_engine.py::test_every_collective_matches_numpy[4-2]",
    "engine/test_engine.py::test_node_gather_scatter_all_to_all_through_the_engine[10001-0]",
    "engine/test_engine.py::test_node_gather_scatter_all_to_all_through_the_engine[100-0]",
    "engine/test_engine.py::test_mismatch_fails_every_rank_and_reduces_nothing[2-2-count]",
    "engine/test_engine.py::test_mismatch_fails_every_rank_and_reduces_nothing[2-1-dtype]",
    "engine/test_engine.py::test_gather_scatter_mismatch_fails_every_rank[2-1-reduce_scatter]",
]
FULL_ENGINE_TESTS = ["engine/test_engine.py"]


@dataclass
class Row:
    build: str
    env: dict
    status: str = "failed"  # passed | failed | skipped
    reason: str = ""  # why it failed or was skipped
    root: str = ""
    engine: str = ""
    compiler: str = ""
    runtime: str = ""
    needed: list = field(default_factory=list)
    exported: list = field(default_factory=list)
    exported_std: int | None = None
    exports_ok: bool | None = None
    engine_tests: str = ""
    engine_tests_ok: bool | None = None
    torch_smoke: str = ""
    torch_smoke_ok: bool | None = None
    smoke_details: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)  # build, exports, engine_tests, torch_smoke, total


def missing(variant: Variant) -> str | None:
    """Why the variant cannot be built here (None when it can)."""
    absent = [t for t in variant.needs if shutil.which(t) is None]
    if not absent:
        return None
    return f"{' and '.join(absent)} not found; install with `{variant.fix}` (./dev.sh test does)"


def build(variant: Variant) -> Path:
    """Builds into build/variants/matrix-<name>; returns the root holding its sdp_jupyter package."""
    from helpers.native_builds import build_variant

    return build_variant(variant.folder, variant.env)


def engine_of(root: Path) -> Path:
    return next((Path(root) / "sdp_jupyter").glob("_engine*.so"))


def native_check(root: Path):
    """sdp_jupyter/_native_check.py of the variant, loaded by path (no import of the package)."""
    path = Path(root) / "sdp_jupyter" / "_native_check.py"
    spec = importlib.util.spec_from_file_location(f"_native_check_{abs(hash(str(root)))}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    return mod


def compiler_of(path: Path) -> str:
    """The compiler named in the object's .comment section (clang's when clang built it: the C
    runtime's start files add GCC's line to every object)."""
    data = Path(path).read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = secs[shstrndx][4]
    for sh in secs:
        name = data[names_off + sh[0]:data.index(b"\0", names_off + sh[0])]
        if name == b".comment":
            lines = [s.decode("utf-8", "replace") for s in data[sh[4]:sh[4] + sh[5]].split(b"\0") if s]
            clang = [s for s in lines if "clang" in s]
            return (clang or lines or ["?"])[0].replace("GCC: ", "gcc ")
    return "?"


def short_compiler(comment: str) -> str:
    """'GCC: (Debian 12.2.0-14) 12.2.0' -> 'gcc 12.2.0'; 'Debian clang version 14.0.6' -> 'clang 14.0.6'."""
    m = re.search(r"clang version (\S+)", comment) or re.search(r"^gcc \(.*\) (\S+)", comment)
    return f"{'clang' if 'clang' in comment else 'gcc'} {m.group(1)}" if m else comment[:30]


def exports(root: Path) -> dict:
    """What the variant's engine links and exports, and whether that is safe beside torch."""
    engine = engine_of(root)
    report = native_check(root).inspect(str(engine))
    runtime = next((n for n in report.needed if n.startswith(("libstdc++", "libc++"))), None)
    return {"engine": str(engine), "compiler": compiler_of(engine), "needed": report.needed,
            "exported": report.exported, "exported_std": len(report.exported_std),
            "runtime": f"shared {runtime}" if runtime else "static, private",
            "ok": not report.exported_std and not report.exported_other, "problem": report.problem()}


def engine_tests(root: Path, fast: bool, deselect: tuple = ()) -> tuple[bool, str, str]:
    """tests/engine/test_engine.py (or --fast's selection) on the variant: (ok, summary, output tail)."""
    from helpers.native_builds import run_pytest

    args = [a for t in deselect for a in ("--deselect", t)]  # (run_pytest keeps the checkout off the path)
    p = run_pytest(root, args + (FAST_ENGINE_TESTS if fast else FULL_ENGINE_TESTS), timeout=900)
    out = p.stdout + p.stderr
    last = [ln for ln in out.strip().splitlines() if ln.strip()]
    summary = re.sub(r" \(\d+:\d\d:\d\d\)", "", last[-1].strip("= ")) if last else f"exit {p.returncode}"
    return p.returncode == 0, summary, out[-4000:]


# ---- the torch smoke -------------------------------------------------------------------------

SMOKE_STEPS = 3
# The error of smoke_rank's mismatched all_reduce, numbers included. Before 21dc596 the engine
# built with a static libstdc++ printed "all_reduce #: element count ..." here beside torch's.
MISMATCH = re.compile(r"collective mismatch at all_reduce #\d+ \(1[02] x float32, SUM\): element count differs: "
                      r"rank 0 has 10, rank 1 has 12; nothing was reduced")


def smoke_rank(steps: int = SMOKE_STEPS) -> dict:
    """One rank (run by tests/helpers/rank_entry.py): torch first, then smddp through stock torch."""
    early = sorted(m for m in sys.modules if m.split(".")[0] == "sdp_jupyter")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    with open("/proc/self/maps") as f:
        cxx = sorted({ln.split()[-1] for ln in f if "libstdc++" in ln or "libc++" in ln})
    engine_loaded_by_torch = "sdp_jupyter._engine" in sys.modules
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("smddp", rank=rank, world_size=world)  # env:// from MASTER_ADDR/PORT
    out: dict = {"early": early, "cxx_runtime_before": cxx, "engine_loaded_by_torch": engine_loaded_by_torch,
                 "engine": getattr(sys.modules.get("sdp_jupyter._engine"), "__file__", None),
                 "backend": dist.get_backend()}

    t = torch.arange(1000, dtype=torch.float32) + rank
    dist.all_reduce(t)
    big = torch.full((1 << 18,), float(rank + 1))  # 1 MiB: the chunked path
    dist.all_reduce(big)
    half = torch.full((4097,), 0.5 * (rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(half)
    tri = world * (world + 1) / 2
    out["all_reduce"] = (torch.equal(t, torch.arange(1000, dtype=torch.float32) * world + world * (world - 1) / 2)
                         and bool((big == tri).all()) and bool((half.float() == 0.5 * tri).all()))

    gloo = dist.new_group(backend="gloo")

    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        ddp = DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
        for _ in range(steps):
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 2, generator=data)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    mine, theirs = train(None), train(gloo)
    out["ddp_max_diff_vs_gloo"] = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
    out["ddp_weights"] = [p.tolist() for p in mine]

    peer = 1 - rank if rank < 2 else None
    if peer is not None:
        msg = torch.arange(5, dtype=torch.float64) + 10
        got = torch.empty(5, dtype=torch.float64)
        if rank == 0:
            dist.send(msg, 1)
            dist.recv(got, 1)
            out["send_recv"] = got.tolist() == (msg * 2).tolist()
        else:
            dist.recv(got, 0)
            dist.send(got * 2, 0)
            out["send_recv"] = got.tolist() == msg.tolist()

    # the error path formats the collective's description (numbers) beside torch's libstdc++
    try:
        dist.all_reduce(torch.ones(10 + 2 * rank))
        out["mismatch"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the text is checked
        out["mismatch"] = str(exc)
    dist.destroy_process_group()
    return out


def torch_smoke(root: Path, timeout: float = 240) -> tuple[bool, str, dict]:
    """2 ranks of smoke_rank on the variant's package (a fresh process starts them with
    SDP_TEST_PACKAGE_ROOT set, as run_pytest does). Returns (ok, summary, details)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update({"SDP_TEST_PACKAGE_ROOT": str(root),
                "PYTHONPATH": os.pathsep.join([str(TOOLS), env.get("PYTHONPATH", "")])})
    p = subprocess.run([sys.executable, __file__, "--smoke-ranks", str(timeout)], capture_output=True, text=True,
                       env=env, timeout=timeout + 60, cwd=str(REPO))
    try:
        details = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"exit {p.returncode}", {"output": (p.stdout + p.stderr)[-4000:]}
    problems = _smoke_problems(details, Path(root))
    details["problems"] = problems
    if problems:
        return False, problems[0][:120], details
    return True, "all_reduce, DDP = gloo, send/recv", details


def _smoke_ranks_main(timeout: float) -> None:
    """Child of torch_smoke: start the ranks, print what they returned as one JSON line."""
    from helpers.ranks import run_ranks

    results = run_ranks("build_matrix:smoke_rank", 2, 2, args=(SMOKE_STEPS,), timeout=timeout)
    print(json.dumps({"ranks": [{"rank": r.rank, "ok": r.ok, "returncode": r.returncode, "value": r.value,
                                 "error": r.error, "output": "" if r.ok else r.output[-3000:]} for r in results]}))


def _smoke_problems(details: dict, root: Path) -> list[str]:
    ranks = details["ranks"]
    bad = [r for r in ranks if not r["ok"]]
    if bad:
        return [f"rank {r['rank']} failed (exit {r['returncode']}): {r['error'] or r['output'][-300:]}"
                f"\n{r['output']}" for r in bad]
    problems = []
    for r in ranks:
        v, who = r["value"], f"rank {r['rank']}"
        if v["early"]:
            problems.append(f"{who} had {v['early']} imported before torch")
        if v["engine_loaded_by_torch"]:
            problems.append(f"{who}: `import torch` loaded the engine before torch's libraries")
        if not v["engine"] or not str(Path(v["engine"]).resolve()).startswith(str(root.resolve())):
            problems.append(f"{who} ran engine {v['engine']}, not the variant's under {root}")
        if v["backend"] != "smddp":
            problems.append(f"{who}'s default group is {v['backend']}")
        if not v["all_reduce"]:
            problems.append(f"{who}: all_reduce gave wrong values")
        if v["ddp_max_diff_vs_gloo"] > 1e-6:
            problems.append(f"{who}: DDP on smddp differs from gloo by {v['ddp_max_diff_vs_gloo']:g}")
        if v.get("send_recv") is not True:
            problems.append(f"{who}: send/recv gave wrong values")
        if not MISMATCH.search(v["mismatch"]):  # numbers missing: the C++ runtime's copies got mixed
            problems.append(f"{who}: a mismatched all_reduce said {v['mismatch']!r}, not /{MISMATCH.pattern}/")
    if ranks[0]["value"]["ddp_weights"] != ranks[1]["value"]["ddp_weights"]:
        problems.append("the ranks' DDP weights differ")
    for r in ranks:
        r["value"].pop("ddp_weights")  # compared; too long for the JSON
    return problems


# ---- one row, the table ----------------------------------------------------------------------

def check_built(row: Row, root: Path, fast: bool) -> Row:
    """Exports, engine tests and torch smoke of an already built variant (row.build names it), into `row`."""
    t = time.monotonic()
    e = exports(root)
    row.seconds["exports"] = round(time.monotonic() - t, 2)
    row.root, row.engine, row.compiler, row.runtime = str(root), e["engine"], e["compiler"], e["runtime"]
    row.needed, row.exported, row.exported_std, row.exports_ok = e["needed"], e["exported"], e["exported_std"], e["ok"]

    t = time.monotonic()
    deselect = VARIANTS[row.build].deselect if row.build in VARIANTS else ()
    row.engine_tests_ok, row.engine_tests, tail = engine_tests(root, fast, deselect)
    row.seconds["engine_tests"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    row.torch_smoke_ok, row.torch_smoke, row.smoke_details = torch_smoke(root)
    row.seconds["torch_smoke"] = round(time.monotonic() - t, 1)

    failed = []
    if "clang" in row.env.get("CXX", "") and "clang" not in row.compiler:
        failed.append(f"CXX={row.env['CXX']} but the engine's .comment names {row.compiler!r}")
    if "-static-libstdc++" in row.env.get("LDFLAGS", "") and not row.runtime.startswith("static"):
        failed.append(f"LDFLAGS={row.env['LDFLAGS']} but the engine loads {row.runtime}: the static case went unchecked")
    if not row.exports_ok:
        failed.append(e["problem"] or f"exports {row.exported} (only PyInit__engine is allowed)")
    if not row.engine_tests_ok:
        failed.append(f"engine tests: {row.engine_tests}\n{tail}")
    if not row.torch_smoke_ok:
        failed.append(f"torch smoke: {row.torch_smoke}\n" + "\n".join(row.smoke_details.get("problems", []))
                      + row.smoke_details.get("output", ""))
    row.status = "failed" if failed else "passed"
    row.reason = "\n".join(failed)
    return row


def run_row(variant: Variant, fast: bool) -> Row:
    row = Row(variant.name, variant.env)
    start = time.monotonic()
    why = missing(variant)
    if why:
        row.status, row.reason = "skipped", why
        return row
    try:
        root = build(variant)
    except Exception as exc:  # noqa: BLE001 - a failed build is a failed row
        row.reason = str(exc)
        row.seconds["build"] = row.seconds["total"] = round(time.monotonic() - start, 1)
        return row
    row.seconds["build"] = round(time.monotonic() - start, 1)
    check_built(row, root, fast)
    row.seconds["total"] = round(time.monotonic() - start, 1)
    return row


def table(rows: list[Row]) -> str:
    head = ["build", "compiler", "runtime", "exported/std", "engine tests", "torch smoke", "seconds", "result"]
    lines = []
    for r in rows:
        s = r.seconds
        secs = " ".join(f"{k[0] if k != 'exports' else 'x'}{v:g}" for k, v in s.items() if k != "total")
        ok = lambda b, text: "" if b is None else ("ok " if b else "FAIL ") + text  # noqa: E731
        lines.append([r.build, short_compiler(r.compiler), r.runtime,
                      "" if r.exported_std is None else f"{len(r.exported)}/{r.exported_std}",
                      ok(r.engine_tests_ok, r.engine_tests)[:40], ok(r.torch_smoke_ok, r.torch_smoke)[:44],
                      f"{s.get('total', round(sum(s.values()), 1)):g} ({secs})" if s else "", r.status.upper()])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(ln) for ln in lines]
    out.append("seconds: total (b build, x export check, e engine tests, t torch smoke)")
    for r in rows:
        if r.status != "passed" and r.reason:
            out.append(f"\n{r.build} {r.status}: " + (r.reason if len(r.reason) < 2500 else "..." + r.reason[-2500:]))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help="a selection of the engine tests (well under a minute)")
    ap.add_argument("--only", help="comma-separated rows: " + ",".join(VARIANTS))
    ap.add_argument("--json", default=str(REPO / "build" / "build_matrix.json"), help="where to write the rows")
    ap.add_argument("--smoke-ranks", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke_ranks:
        _smoke_ranks_main(a.smoke_ranks)
        return 0
    names = [n.strip() for n in a.only.split(",")] if a.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown build(s) {unknown}; choose from {list(VARIANTS)}")
    start = time.monotonic()
    rows = []
    for name in names:
        print(f"[build_matrix] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_row(VARIANTS[name], a.fast))
        print(f"[build_matrix] {name}: {rows[-1].status} in {rows[-1].seconds.get('total', 0):g} s",
              file=sys.stderr, flush=True)
    took = round(time.monotonic() - start, 1)
    print(table(rows))
    print(f"\n{len(rows)} build(s) in {took:g} s ({'--fast' if a.fast else 'full engine tests'})")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"fast": a.fast, "seconds": took, "python": sys.version.split()[0],
                                        "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"written: {a.json}")
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
