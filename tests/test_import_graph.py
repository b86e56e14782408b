"""The package's imports point one way: no circles, the engine never imports the book's machinery, kernels never
import the engine. Read from the source with `ast` (every import counts, inside functions too), so nothing has to
be imported to check it and a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"minillm": ROOT / "minillm", "minillm.kernels": ROOT / "kernels"}  # kernels/ installs as minillm.kernels


def modules() -> dict[str, Path]:
    """Every module of the project by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports: `import a.b`, `from a import b` (b a module or a name in a)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module, then up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name and target != "minillm":  # `from minillm import x`: the top, not a cycle
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_engine_and_its_edges():
    """A check that cannot fail is no check: the graph must hold the modules and edges we know exist."""
    edges = graph()
    assert "minillm.engine.llm_engine" in edges and "minillm.kernels.decode_attention" in edges
    assert "minillm.engine.scheduler" in edges["minillm.engine.llm_engine"]
    assert "minillm.model" in edges["minillm.engine.kv_cache"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    found = circles(graph())
    assert not found, ("import circles (each line a set of modules that import each other, directly or not): "
                       + "; ".join(" <-> ".join(c) for c in found)
                       + ". Move what both need below both, or pass it in, so imports point one way.")


def test_the_engine_never_imports_the_book_machinery():
    """minillm.book (book.yml, the site, notebook helpers, grading) sits on top; nothing else in minillm imports it
    (the CLI, which offers the book's commands, is the one door between them)."""
    bad = [f"{m} -> {t}" for m, targets in graph().items() for t in targets
           if t.startswith("minillm.book") and not m.startswith("minillm.book") and m != "minillm.cli"]
    assert not bad, f"engine modules import the book's machinery: {bad}. Keep the engine free of it."


def test_kernels_import_nothing_of_the_engine():
    bad = [f"{m} -> {t}" for m, targets in graph().items() if m.startswith("minillm.kernels") for t in targets
           if not t.startswith("minillm.kernels")]
    assert not bad, f"kernels import the engine: {bad}. A kernel and its reference take tensors, not engine objects."


def test_the_engine_takes_its_block_counts_from_utils_not_the_whiteboard():
    """`minillm.arithmetic` is chapter 02's whiteboard (bytes, FLOPs, rooflines, costs); the engine needs only
    `cdiv` and `kv_blocks`, which live in `minillm.utils`."""
    bad = [m for m, targets in graph().items() if m.startswith("minillm.engine") and "minillm.arithmetic" in targets]
    assert not bad, f"engine modules import minillm.arithmetic: {bad}. Import cdiv / kv_blocks from minillm.utils."
    assert "minillm.utils" in graph()["minillm.engine.scheduler"], "the check must see the engine's real imports"


# The floors of ARCHITECTURE.md, lowest first: a module may import its own room and the rooms on its floor or
# below, never a room above (the package `minillm` itself, whose names load lazily, is not an import of anything).
FLOORS = {
    "minillm.kernels": 0,
    **{f"minillm.{m}": 1 for m in ("config", "utils", "tokenizer", "quant", "lora", "model", "contiguous_cache",
                                   "arithmetic", "shipped", "checkpoints", "formats")},
    "minillm.sampler": 2,
    "minillm.engine": 3,
    "minillm.decoding": 4, "minillm.parallel": 4,
    "minillm.train": 5,
    "minillm.eval": 6,
    "minillm.book": 7,
    "minillm.entrypoints": 8,
    "minillm.cli": 9,
}
# Known upward imports, each with the change that removes it (none left: tensor parallelism, which LLMEngine used
# to start itself, is a group the front door starts and passes in, `LLMEngine(..., group=...)`).
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def room_of(module: str) -> str:
    """The room (FLOORS key) a module lives in: its package under minillm, or itself on the ground floor."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_every_module_lives_in_a_room_with_a_floor():
    unplaced = sorted(m for m in modules() if m != "minillm" and room_of(m) not in FLOORS)
    assert not unplaced, (f"modules in no room of ARCHITECTURE.md: {unplaced}. Put each in a room (or give its new "
                          "room a floor in FLOORS and in ARCHITECTURE.md).")


def test_imports_point_down_the_floors():
    edges = graph()
    up = sorted(f"{m} (floor {FLOORS[room_of(m)]}) -> {t} (floor {FLOORS[room_of(t)]})"
                for m, targets in edges.items() if m != "minillm" for t in targets
                if FLOORS.get(room_of(t), -1) > FLOORS.get(room_of(m), 99) and (m, t) not in UPWARD_ALLOWED)
    assert not up, ("imports that climb a floor (ARCHITECTURE.md, 'the rules'): " + "; ".join(up)
                    + ". Move what both need down, or pass it in from above.")
    stale = [pair for pair in UPWARD_ALLOWED if pair[1] not in edges.get(pair[0], set())]
    assert not stale, f"UPWARD_ALLOWED lists imports that no longer exist: {stale}; remove them"
    # the check sees real edges: a made-up upward import is caught
    assert FLOORS[room_of("minillm.engine.scheduler")] < FLOORS[room_of("minillm.entrypoints.server")]


def test_the_top_level_is_the_ground_floor_only():
    """At most ten flat modules at minillm/'s top level, and no two modules in the project share a file name."""
    flat = sorted(p.name for p in (ROOT / "minillm").glob("*.py"))
    assert len(flat) <= 10, f"{len(flat)} flat modules at minillm/'s top level: {flat}; give the new ones a room"
    names = [p.name for folder in PACKAGES.values() for p in folder.rglob("*.py") if p.name != "__init__.py"]
    shared = sorted({n for n in names if names.count(n) > 1})
    assert not shared, f"modules that share a file name: {shared}; name each for its concept"


def test_no_public_name_is_also_a_module_of_the_package():
    """`minillm.sample` is a function; a room named `minillm/sample/` would replace it with the package the moment
    anything imports the room (a submodule import sets the attribute on its parent)."""
    import minillm

    clashes = sorted(name for name in minillm.__all__
                     if (ROOT / "minillm" / name).is_dir() or (ROOT / "minillm" / f"{name}.py").is_file())
    assert not clashes, f"public names of minillm that are also its modules: {clashes}; rename the module"
    assert "sample" in minillm.__all__, "the check must see the public names"


def test_one_input_builder_and_a_graph_runner():
    """A step's input columns are written in one module, `minillm.engine.step_inputs`: the graph runner and the
    compiled step copy its rows and never fill one (no column name of a decode row in them), and `cuda_graphs.py`
    stays the graph runner alone (capture, buffers, replay: at most 200 lines, mini-sglang's is 171)."""
    engine = ROOT / "minillm" / "engine"
    for name in ("cuda_graphs.py", "compiled_step.py", "model_runner.py", "kv_cache.py", "llm_engine.py"):
        tree = ast.parse((engine / name).read_text())
        used = sorted({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
                      & {"POSITION", "SLOT", "SEQ_LEN", "staging"})
        assert not used, f"engine/{name} writes a step's columns itself ({used}): build rows in step_inputs"
    lines = len((engine / "cuda_graphs.py").read_text().splitlines())
    assert lines <= 200, f"engine/cuda_graphs.py has {lines} lines: keep it the graph runner alone (<= 200)"
    builder = ast.parse((engine / "step_inputs.py").read_text())
    assert {"POSITION", "SLOT", "SEQ_LEN"} <= {n.id for n in ast.walk(builder) if isinstance(n, ast.Name)}
