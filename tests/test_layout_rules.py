"""Sizes a person can hold, names that say one job, layers that import only downwards, and no import circles, in
hvd_partialfc/ and data_tools/: kept by this test so later work keeps them (docs/architecture.md says why)."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

from conftest import ROOT

PACKAGES = ("hvd_partialfc", "data_tools")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300

# docs/architecture.md's layers, top first. A module imports its own group or any layer below; the groups of
# one layer do not import each other (the four parts stand side by side). Every module is in one layer.
LAYERS = [
    [("hvd_partialfc.cli", "hvd_partialfc.cli_train", "hvd_partialfc.cli_support", "hvd_partialfc.config_docs",
      "data_tools")],
    [("hvd_partialfc.tools",)],
    # run/ by concern: the loop on top (start-up, the loop, its log, the parts it builds, the step), then its rooms
    [("hvd_partialfc.run",)],
    [("hvd_partialfc.run.snapshots",)],       # memory snapshots: they may use checkpoints' files, never the loop
    [("hvd_partialfc.run.ckpt",)],            # checkpoints, resume, re-sharding, upgrade: knows no snapshot
    [("hvd_partialfc.run.progress", "hvd_partialfc.run.speed", "hvd_partialfc.run.skips",
      "hvd_partialfc.run.metrics_log")],      # what the step and the checkpoints share: run length, speed keys
    [("hvd_partialfc.run.watch",)],           # what watches a run (signals, stragglers, faults, the run lock)
    [("hvd_partialfc.verification",)],
    [("hvd_partialfc.classifier",), ("hvd_partialfc.engine",), ("hvd_partialfc.data",), ("hvd_partialfc.models",)],
    [("hvd_partialfc", "hvd_partialfc.config", "hvd_partialfc.config_io", "hvd_partialfc.seeds",
      "hvd_partialfc.atomic", "hvd_partialfc.digest", "hvd_partialfc.run_files", "hvd_partialfc.sizes",
      "hvd_partialfc.registry", "hvd_partialfc.forking")],
]


def _modules():
    """{dotted module name: (path, is_package)} of every .py under the two packages."""
    out = {}
    for pkg in PACKAGES:
        for dp, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dp, f), ROOT)[:-3].replace(os.sep, ".")
                    is_pkg = rel.endswith(".__init__")
                    out[rel[:-len(".__init__")] if is_pkg else rel] = (os.path.join(dp, f), is_pkg)
    return out


MODULES = _modules()


def _imports(name, path, is_pkg):
    """Every module of the two packages that ``name`` imports, at any depth of its code (function-level
    imports hide a circle, they do not remove it)."""
    tree = ast.parse(open(path).read(), path)
    here = name if is_pkg else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:       # `import a.b.c` names a.b.c; a symbol names its module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def test_module_and_class_sizes():
    big = {m: n for m, (p, _) in MODULES.items() if (n := len(open(p).read().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split by job, not by count): {big}"
    classes = {}
    for m, (p, _) in MODULES.items():
        for node in ast.walk(ast.parse(open(p).read())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                classes[f"{m}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not classes, f"classes over {MAX_CLASS_LINES} lines: {classes}"


def test_no_two_modules_share_a_name():
    by_name = defaultdict(list)
    for m in MODULES:
        leaf = m.rsplit(".", 1)[-1]
        if not MODULES[m][1] and leaf not in ("__main__",):
            by_name[leaf].append(m)
    assert {k: v for k, v in by_name.items() if len(v) > 1} == {}


def _place(module, layers):
    """(layer index, group index) of the longest prefix of ``module`` named in ``layers``; None if none."""
    best = None
    for i, groups in enumerate(layers):
        for j, group in enumerate(groups):
            for prefix in group:
                if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[2]):
                    best = (i, j, len(prefix))
    return best[:2] if best else None


def _upward(graph, layers):
    """Imports that point up a layer or across to another group of the same layer, and unplaced modules."""
    bad, unplaced = [], sorted(m for m in graph if _place(m, layers) is None)
    for m, deps in graph.items():
        here = _place(m, layers)
        for d in deps:
            there = _place(d, layers)
            if here and there and (there[0] < here[0] or (there[0] == here[0] and there[1] != here[1])):
                bad.append(f"{m} -> {d}")
    return sorted(bad), unplaced


def test_imports_only_point_down():
    graph = {m: _imports(m, p, pkg) for m, (p, pkg) in MODULES.items()}
    bad, unplaced = _upward(graph, LAYERS)
    assert unplaced == [], f"modules in no layer (add them to LAYERS and docs/architecture.md): {unplaced}"
    assert bad == [], f"imports that point up a layer or across to a sibling: {bad}"
    # the rule can fail: the three imports that pointed up before they moved
    old = {"hvd_partialfc.run.ckpt.checkpoint_files": {"hvd_partialfc.tools.estimate"},
           "hvd_partialfc.verification.suite": {"hvd_partialfc.tools.export"},
           "hvd_partialfc.models.pretrained": {"hvd_partialfc.run.ckpt.checkpoint_files", "hvd_partialfc.engine.base"},
           "hvd_partialfc.cli": {"hvd_partialfc.run.trainer"},
           # the rooms of run/: recovery that called back into the snapshots, a watch that reached for the loop
           "hvd_partialfc.run.ckpt.resume": {"hvd_partialfc.run.snapshots.memory_recover"},
           "hvd_partialfc.run.watch.stragglers": {"hvd_partialfc.run.trainer"}}
    assert _upward(old, LAYERS)[0] == ["hvd_partialfc.models.pretrained -> hvd_partialfc.engine.base",
                                      "hvd_partialfc.models.pretrained -> hvd_partialfc.run.ckpt.checkpoint_files",
                                      "hvd_partialfc.run.ckpt.checkpoint_files -> hvd_partialfc.tools.estimate",
                                      "hvd_partialfc.run.ckpt.resume -> hvd_partialfc.run.snapshots.memory_recover",
                                      "hvd_partialfc.run.watch.stragglers -> hvd_partialfc.run.trainer",
                                      "hvd_partialfc.verification.suite -> hvd_partialfc.tools.export"]


def test_no_import_circles():
    graph = {m: _imports(m, p, pkg) for m, (p, pkg) in MODULES.items()}
    # Tarjan's strongly connected components: any component of more than one module is a circle
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


def test_the_rules_can_fail(tmp_path):
    """The circle finder sees a circle hidden in a function, through a package's __init__."""
    global MODULES
    saved = MODULES
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from .b import g\n")
    b.write_text("from . import a\n")
    MODULES = {"p": (str(tmp_path / "__init__.py"), True), "p.a": (str(a), False), "p.b": (str(b), False)}
    try:
        assert _imports("p.a", str(a), False) == {"p.b"} and _imports("p.b", str(b), False) == {"p.a"}
    finally:
        MODULES = saved


def test_every_script_the_docs_name_exists():
    """Every ``launch/...``, ``scripts/...``, ``tests/...``, ``data_tools/...`` or ``hvd_partialfc/...`` file that
    README.md, docs/, launch/'s and scripts/' READMEs and scripts name is there, and every ``-m scripts.X.Y``
    module they run (scripts that moved out of launch/ kept their documented commands working)."""
    import re
    texts = [os.path.join(ROOT, "README.md")]
    texts += [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")]
    for folder in ("launch", "scripts"):
        for dp, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            texts += [os.path.join(dp, f) for f in files if f.endswith((".py", ".sh", ".sbatch", ".md"))]
    pattern = re.compile(r"(?<![\w/.-])((?:launch|scripts|tests|data_tools|hvd_partialfc)/[\w/.-]*"
                         r"\.(?:py|sh|sbatch|md|json|yaml))")
    module = re.compile(r"-m (scripts(?:\.\w+)+)")
    missing = sorted({f"{os.path.relpath(t, ROOT)}: {m}" for t in texts for m in pattern.findall(open(t).read())
                      if not os.path.exists(os.path.join(ROOT, m))})
    missing += sorted({f"{os.path.relpath(t, ROOT)}: -m {m}" for t in texts for m in module.findall(open(t).read())
                       if not os.path.isfile(os.path.join(ROOT, *m.split(".")) + ".py")})
    assert not missing, missing


# launch/ holds the launchers only (a user finds theirs with `ls launch`); set-up, the fault harness, the GPU
# checks and the studies live under scripts/ (scripts/README.md)
LAUNCHERS = {"README.md", "horovodrun.sh", "horovodrun_elastic.sh", "mpirun.sh", "horovod_restarts.py", "slurm_horovod.sbatch", "torchrun.sh",
             "torch_inprocess.py",
             "slurm_torchrun.sbatch", "build_shards.sbatch", "build_shards_mpirun.sh"}


def test_launch_holds_only_launchers():
    """launch/ has exactly the launchers (no folder; __pycache__, an ignored build output, aside), and no test
    puts either folder on the path by hand (a path insert naming it): scripts/ is a package (``from scripts.faults
    import twonode``), and setup.cfg's ``pythonpath = .`` puts the repository root on pytest's path."""
    entries = {e for e in os.listdir(os.path.join(ROOT, "launch")) if e != "__pycache__"}
    folders = sorted(e for e in entries if os.path.isdir(os.path.join(ROOT, "launch", e)))
    assert not folders, f"folders in launch/: {folders}"
    assert entries == LAUNCHERS, (f"not launchers (move them under scripts/): {sorted(entries - LAUNCHERS)}; "
                                  f"missing: {sorted(LAUNCHERS - entries)}")
    bad, insert = [], "sys.path." + "insert"      # split: this file's own lines would match
    for dp, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                for i, line in enumerate(open(path).read().splitlines(), 1):
                    if insert in line and ("launch" in line or "scripts" in line):
                        bad.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not bad, bad


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's "where each module lives" names every module of the package by its path under
    hvd_partialfc/ (and every data_tools module by its file name): a module added without a word there fails."""
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = []
    for m, (path, is_pkg) in MODULES.items():
        rel = os.path.relpath(path, ROOT)
        if is_pkg:
            continue
        named = rel[len("hvd_partialfc/"):] if rel.startswith("hvd_partialfc/") else os.path.basename(rel)
        if f"`{named}`" not in page and f" {named}" not in page and f"`{named}" not in page:
            missing.append(rel)
    assert not missing, f"modules docs/architecture.md does not name: {missing}"
