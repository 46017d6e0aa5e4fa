"""The import graph of sdp_jupyter (docs/architecture.md): no cycles, no module imports another
module's _private name, and the launch package's process boundaries hold (a rank never imports the
kernel's code, the host agent neither, the kernel never imports torch).

Every import is an edge, at module level or inside a function (a function-level import is a
dependency too, only a later one), and so is a string naming one of our modules ("pkg.mod" or the
registries' "pkg.mod:attribute", importlib.import_module("...")): a registry imports what it names,
only later; except the one back-edge docs/architecture.md ("Dependencies") allows: a model's lazy
view()/dashboard() import of its widget (dask's _widget idiom), listed in LAZY_VIEWS. The allow-lists
below are empty; the test also fails when an allow-listed item disappears, so the lists cannot go
stale. tests/house/test_architecture_map.py checks the page's edge list against this graph."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "sdp_jupyter"

# Cycles allowed, each as the sorted list of its modules (a strongly connected component): none.
# (The launch/ cycle went with the target registry in launch/targets/__init__.py, the spec/parallel_options one
# with the option building blocks' leaf launch/options.py, the advisor one with advisor.measure.)
KNOWN_CYCLES: list[list[str]] = []

# "importer -> module._name" pairs that exist today.
KNOWN_PRIVATE: set[str] = set()


# The allowed lazy back-edges (docs/architecture.md, "Dependencies"): module -> functions whose imports are not edges.
LAZY_VIEWS: dict[str, tuple[str, ...]] = {
    "sdp_jupyter.launch.kernel.job": ("view", "dashboard"),
    "sdp_jupyter.launch.targets.sagemaker.training_job": ("view",),
    "sdp_jupyter.jobsetup.model": ("view",),
}


def _imports(tree, module: str):
    """(import statement, 'module.function' it sits in, or the module itself at top level);
    `if TYPE_CHECKING:` blocks are skipped (they never run)."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, where
            elif (isinstance(child, ast.Call) and isinstance(child.func, (ast.Attribute, ast.Name))
                  and getattr(child.func, "attr", getattr(child.func, "id", "")) == "import_module"
                  and child.args and isinstance(child.args[0], ast.Constant)
                  and str(child.args[0].value).startswith("sdp_jupyter")):
                # importlib.import_module("sdp_jupyter.x"): an import by name is still an import
                yield ast.Import(names=[ast.alias(name=child.args[0].value)]), where
                yield from walk(child, where)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, f"{module}.{child.name}" if where == module else where)
            else:
                yield from walk(child, where)
    yield from walk(tree, module)


REGISTRY = re.compile(r"^sdp_jupyter(\.[a-z_0-9]+)+(:[A-Za-z_][A-Za-z_0-9]*)?$")


def where_of(tree, target) -> str:
    """The top-level function or method a node sits in ("" at module level), named as _imports names
    it: a lazy view's string is lazy too (Job.dashboard's find_spec("sdp_jupyter.ui.dashboard"))."""
    for top in tree.body:
        for fn in (top.body if isinstance(top, ast.ClassDef) else [top]):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is target for n in ast.walk(fn)):
                return fn.name
    return ""


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if "_compat" not in p.parts}


def resolve(importer: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_pkg else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def graph(strings: bool = True):
    """(edges, private names read); `strings`: a string naming one of our modules is an edge too."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: set[str] = set()
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        lazy_ok = {f"{m}.{fn}" for fn in LAZY_VIEWS.get(m, ())}
        aliases: dict[str, str] = {}
        for st, where in _imports(tree, m):
            if where in lazy_ok:
                continue  # the one allowed back-edge: a model's lazy import of its view
            if True:
                if isinstance(st, ast.Import):
                    targets = [a.name for a in st.names]
                    names = []
                elif isinstance(st, ast.ImportFrom):
                    base = resolve(m, is_pkg, st)
                    targets = [base]
                    names = [a.name for a in st.names]
                    for n in names:  # `from pkg import submodule`
                        if f"{base}.{n}" in mods:
                            targets.append(f"{base}.{n}")
                        elif n.startswith("_") and not n.startswith("__") and base.startswith("sdp_jupyter") \
                                and n != "_engine":  # the native extension module, not a private name
                            private.add(f"{m} -> {base}.{n}")
                else:
                    continue
                for a in (st.names if isinstance(st, ast.Import) else []):
                    if a.asname and a.name in mods:  # `import sdp_jupyter.x as y`: y._name below
                        aliases[a.asname] = a.name
                for a in (st.names if isinstance(st, ast.ImportFrom) else []):
                    if f"{base}.{a.name}" in mods:  # `from sdp_jupyter import x`: x._name below
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                for t in targets:
                    # importing a.b.c runs a and a.b too
                    parts = t.split(".")
                    for i in range(1, len(parts) + 1):
                        dep = ".".join(parts[:i])
                        if dep in mods and dep != m and not m.startswith(dep + "."):
                            edges[m].add(dep)
        for node in ast.walk(tree) if strings else ():  # a registry's "sdp_jupyter.x.y[:attr]" is an import too
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and REGISTRY.match(node.value):
                named = node.value.split(":")[0]
                if named in mods and named != m and (f"{m}.{where_of(tree, node)}" not in lazy_ok):
                    edges[m].add(named)
        for node in ast.walk(tree):  # module._name through an alias of another sdp_jupyter module
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != m
                    and node.attr != "_engine"):
                private.add(f"{m} -> {aliases[node.value.id]}.{node.attr}")
    return edges, private


def cycles(edges) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def test_no_import_cycles():
    found = cycles(graph()[0])
    new = [c for c in found if c not in KNOWN_CYCLES]
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not new, f"import cycles inside sdp_jupyter (break them; docs/architecture.md says there are none): {new}"
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_no_private_imports_across_modules():
    private = graph()[1]
    new = sorted(private - KNOWN_PRIVATE)
    gone = sorted(KNOWN_PRIVATE - private)
    assert not new, f"modules importing another module's _private name (make it public or move it): {new}"
    assert not gone, f"gone: remove from KNOWN_PRIVATE: {gone}"


def test_the_graph_sees_real_edges():
    edges, _ = graph()
    assert "sdp_jupyter.launch.kernel.job" in edges["sdp_jupyter.launch.targets.local.launcher"]
    assert "sdp_jupyter.comm" in edges["sdp_jupyter.torch"]


def test_public_surface_as_the_notebooks_use_it():
    """`import sdp_jupyter` stays torch-free, and the names notebooks and docstrings use resolve."""
    import subprocess
    import sys

    code = ("import sys, sdp_jupyter as s\n"
            "assert 'torch' not in sys.modules and 'ipywidgets' not in sys.modules\n"
            "for n in ('launch', 'Job', 'JobSpec', 'get_job', 'list_jobs', 'report', 'timed', 'checkpoint'):\n"
            "    assert getattr(s, n) is not None and n in s.__all__, n\n"
            "assert callable(s.checkpoint.load) and callable(s.checkpoint.save)\n"
            "assert 'torch' not in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


# The launch package's rooms (docs/architecture.md): which room may import which. The shared leaves
# (launch.spec, launch.options, launch.parallel_options, launch.channel, launch.process) are open to all.
KERNEL, HOST, RANK = "sdp_jupyter.launch.kernel", "sdp_jupyter.launch.host", "sdp_jupyter.launch.rank"
TARGETS = "sdp_jupyter.launch.targets"  # the launchers run in the kernel's process too
FORBIDDEN = {RANK: (KERNEL,), HOST: (KERNEL,)}


def _room(module: str) -> str | None:
    return next((r for r in (KERNEL, HOST, RANK) if module == r or module.startswith(r + ".")), None)


def test_process_boundaries_hold():
    edges, _ = graph()
    crossing = sorted(f"{m} -> {d}" for m, deps in edges.items() for d in deps
                      if _room(m) in FORBIDDEN and _room(d) in FORBIDDEN[_room(m)])
    assert not crossing, f"a rank or host module imports the kernel's code (move the shared part to a leaf): {crossing}"


def test_the_kernel_never_imports_torch():
    """The notebook's process stays torch-free: no module of launch.kernel imports torch, at any depth of
    our own modules (a lazy view's import aside). Imports only: a string naming a module the warm
    pool preloads, or a rank runs, is imported by that other process."""
    edges, _ = graph(strings=False)
    mods = modules()
    torchy = set()
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        for st, _where in _imports(tree, m):
            names = [a.name for a in st.names] if isinstance(st, ast.Import) else [st.module or ""]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                torchy.add(m)
    container = TARGETS + ".sagemaker.entry"  # runs inside a SageMaker training container, as a rank does
    reach, todo = set(), [m for m in edges if (_room(m) == KERNEL or m.startswith(TARGETS + ".")) and m != container]
    while todo:
        m = todo.pop()
        if m in reach:
            continue
        reach.add(m)
        todo += [d for d in edges[m] if not d.startswith(RANK) and d != container]  # ranks are other processes
    assert not sorted(reach & torchy), f"kernel-side modules that import torch: {sorted(reach & torchy)}"


def test_the_boundary_checks_can_fail():
    assert _room("sdp_jupyter.launch.rank.worker") == RANK and _room("sdp_jupyter.launch.spec") is None
    assert "sdp_jupyter.launch.targets.sagemaker" in graph()[0]["sdp_jupyter.launch.targets"]  # FOLDERS' strings


def test_a_rank_and_an_agent_load_none_of_the_kernel():
    """What runs, not only what the graph says: importing the worker or the agent runs the launch
    package's __init__ first, and that must load no kernel module (its names are loaded on first use)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import sdp_jupyter.launch.rank.worker, sdp_jupyter.launch.host.agent, sdp_jupyter.launch.host.warm\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('sdp_jupyter.launch.kernel'))\n"
            "assert not loaded, loaded\n"
            "from sdp_jupyter.launch import Job, launch\n"  # and the public names still resolve
            "assert callable(launch) and Job.__module__ == 'sdp_jupyter.launch.kernel.job'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
