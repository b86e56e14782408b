"""Reading a notebook's source for answers that are not the reader's own (all chapters, `minillm grade`).

An exercise asks for a function the engine already has. `minillm grade` gives no credit to an
answer that *is* the engine's function, or calls it. It looks twice:

1. here, in the notebook's text, which the notebook cannot change while it runs: which name each
   `check("NN.task", answer)` hands in, where that name is bound (`def`, `lambda`, assignment,
   import), and every dotted name that binding and the notebook functions it uses refer to,
   resolved through the notebook's imports ("S.top_p_filter" after `from minillm import sampling
   as S` is "minillm.sampler.sampling.top_p_filter");
2. in the sandbox, while the tests call the answer, a profiler notes every call of a forbidden
   function however it was reached (`getattr` on a string, say); see `minillm.book.grading.sandbox`.

Names are compared by the objects they resolve to, so a re-export (`minillm.load` and
`minillm.checkpoints.load`) is the same name.
"""

from __future__ import annotations

import ast
import importlib
import threading
from dataclasses import dataclass, field
from typing import Any

GRADER_PACKAGE = "minillm.book.grading"  # holds the grader's own answers: an answer may not use it...
ALLOWED_GRADER_NAMES = {"minillm.book.grading.check", "minillm.book.grading.check.check"}  # ...except `check` itself


_PARSE_LOCK = threading.Lock()


def _parse(source: str, mode: str = "exec") -> ast.AST:
    """`ast.parse`, one thread at a time: CPython 3.11's parser can fail with "AST constructor recursion
    depth mismatch" when threads parse at once (`minillm grade -j N` grades notebooks in threads)."""
    with _PARSE_LOCK:
        return ast.parse(source, mode=mode)


@dataclass
class NotebookSource:
    """A notebook's code, parsed: imports, bindings, and the answer each `check` call hands in.

    imports:  local name -> the dotted path it stands for ("S" -> "minillm.sampler.sampling")
    bindings: local name -> every node that binds it (FunctionDef, ClassDef, Lambda or an assigned value)
    checked:  task id -> the source of the last `check(task_id, <answer>)` call's answer
    unparsed: code cell number -> its syntax error ("line 3: invalid syntax"); such cells are skipped
    suspicious: review flags: constructs an honest exercise has no use for ("code cell 4, line 2: uses gc")
    """

    imports: dict[str, str] = field(default_factory=dict)
    bindings: dict[str, list[ast.AST]] = field(default_factory=dict)
    checked: dict[str, str] = field(default_factory=dict)
    unparsed: dict[int, str] = field(default_factory=dict)
    suspicious: list[str] = field(default_factory=list)


def read_source(cells: list[str]) -> NotebookSource:
    """Parse the code cells (IPython magics turned into Python first)."""
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    src = NotebookSource()
    for number, cell in enumerate(cells, 1):
        try:
            tree = _parse(transform(cell))
        except SyntaxError as exc:
            src.unparsed[number] = f"line {exc.lineno}: {exc.msg}" + (f": {exc.text.strip()}" if exc.text else "")
            continue
        for node in ast.walk(tree):  # imports anywhere (one inside a function counts too), check calls
            _record_import_or_check(node, src)
            why = _suspicious(node)
            if why:
                flag = f"code cell {number}, line {getattr(node, 'lineno', '?')}: {why}"
                if not any(f.endswith(why) for f in src.suspicious):
                    src.suspicious.append(flag)
        for statement in tree.body:
            _record_bindings(statement, src)
    return src


# What an honest exercise has no use for: reaching into the interpreter, the grader or other files.
_SUSPICIOUS_MODULES = {"gc": "the garbage collector's view of every object", "ctypes": "C-level memory access",
                       "importlib": "imports computed at run time", "linecache": "reading source files"}
_SUSPICIOUS_ATTRIBUTES = {
    "setprofile": "switching the profiler", "settrace": "switching the tracer", "_getframe": "reading call frames",
    "_current_frames": "reading call frames", "f_back": "reading call frames", "f_globals": "reading call frames",
    "getsource": "reading another function's source", "getsourcelines": "reading another function's source",
    "getsourcefile": "reading another function's source", "get_objects": "searching every object",
    "get_referrers": "searching every object", "__code__": "replacing a function's code",
    "__globals__": "reaching into a function's globals", "__closure__": "reaching into a closure",
}
_SUSPICIOUS_CALLS = {"exec": "running code from a string", "eval": "running code from a string",
                     "compile": "compiling code from a string", "__import__": "an import computed at run time"}


def _suspicious(node: ast.AST) -> str | None:
    """A review flag for one syntax node, or None."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            top = alias.name.split(".")[0]
            if top in _SUSPICIOUS_MODULES:
                return f"imports {alias.name} ({_SUSPICIOUS_MODULES[top]})"
            if alias.name.startswith(GRADER_PACKAGE):
                return f"imports the grader's {alias.name}"
    elif isinstance(node, ast.ImportFrom) and node.module:
        top = node.module.split(".")[0]
        if top in _SUSPICIOUS_MODULES:
            return f"imports from {node.module} ({_SUSPICIOUS_MODULES[top]})"
        names = {f"{node.module}.{a.name}" for a in node.names}
        if node.module.startswith(GRADER_PACKAGE) and not names <= ALLOWED_GRADER_NAMES:
            return f"imports {', '.join(sorted(names - ALLOWED_GRADER_NAMES))} from the grader"
    elif isinstance(node, ast.Attribute) and node.attr in _SUSPICIOUS_ATTRIBUTES:
        return f"uses .{node.attr} ({_SUSPICIOUS_ATTRIBUTES[node.attr]})"
    elif isinstance(node, ast.Attribute) and node.attr == "modules" and _dotted(node) == "sys.modules":
        return "uses sys.modules (reaching into loaded modules)"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SUSPICIOUS_CALLS:
        return f"calls {node.func.id}() ({_SUSPICIOUS_CALLS[node.func.id]})"
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        if ".ipynb" in node.value:
            return f"names a notebook file ({node.value[:60]!r})"
        if node.value.startswith("/proc"):
            return f"names a /proc path ({node.value[:60]!r})"
    return None


def _record_import_or_check(node: ast.AST, src: NotebookSource) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                src.imports[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                src.imports[top] = top
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for alias in node.names:
            src.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    elif isinstance(node, ast.Call) and _called_name(node.func) == "check" and len(node.args) >= 2:
        task = node.args[0]
        if isinstance(task, ast.Constant) and isinstance(task.value, str):
            src.checked[task.value] = ast.unparse(node.args[1])


def _record_bindings(node: ast.AST, src: NotebookSource) -> None:
    """Module-level bindings of one statement (not the locals inside function bodies)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        src.bindings.setdefault(node.name, []).append(node)
        return
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    src.bindings.setdefault(name.id, []).append(node.value)
    for child in ast.iter_child_nodes(node):  # if / for / with / try blocks at the top level
        if isinstance(child, ast.stmt):
            _record_bindings(child, src)


def _local_names(node: ast.AST) -> set[str]:
    """Parameters and names assigned inside a function or lambda (they shadow the notebook's globals)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return set()
    args = node.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
            names.add(child.id)
    return names


def _called_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _dotted(node: ast.AST) -> str | None:
    """"a.b.c" for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _names_in(node: ast.AST) -> set[str]:
    """The outermost dotted names a node refers to ("sampling.top_p_filter", "helper", "torch.softmax")."""
    found: set[str] = set()

    def visit(n: ast.AST) -> None:
        dotted = _dotted(n) if isinstance(n, (ast.Attribute, ast.Name)) else None
        if dotted is not None:
            found.add(dotted)
            return
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    return found


def reached_names(src: NotebookSource, expression: str, max_depth: int = 12) -> set[str]:
    """Every dotted path outside the notebook that the answer `expression` refers to, directly or
    through the notebook's own functions, classes and assignments (resolved through its imports)."""
    try:
        start = _parse(expression, mode="eval")
    except SyntaxError:
        return set()
    reached: set[str] = set()
    seen: set[str] = set()
    frontier: list[tuple[ast.AST, int]] = [(start, 0)]
    while frontier:
        node, depth = frontier.pop()
        local = _local_names(node)
        for dotted in _names_in(node):
            head, _, rest = dotted.partition(".")
            if head in local:
                continue
            if head in src.imports:
                reached.add(src.imports[head] + (f".{rest}" if rest else ""))
            elif head in src.bindings and head not in seen and depth < max_depth:
                seen.add(head)
                frontier.extend((b, depth + 1) for b in src.bindings[head])
    return reached


def defines(src: NotebookSource, expression: str) -> bool:
    """Whether the notebook's text binds the answer (a `def`, class, assignment or import of its name;
    an answer written inline in the `check` call, such as a lambda, binds itself)."""
    try:
        node = _parse(expression, mode="eval").body
    except SyntaxError:
        return False
    dotted = _dotted(node)
    if dotted is None:
        return True
    head = dotted.split(".")[0]
    return head in src.bindings or head in src.imports


def resolve(dotted: str) -> Any:
    """The object a dotted path names, importing its module (None if it does not exist)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - not a module (or one that fails to import): try a shorter prefix
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def forbidden_callables(forbidden: tuple[str, ...] | list[str]) -> list[tuple[str, Any]]:
    """(dotted path, callable) for everything the paths forbid: a function itself, or every method of
    a class (a property by its getter, a static or class method by its function). Paths that do not
    resolve are skipped. Shared by the source check here and the sandbox's call watcher."""
    found = []
    for name in forbidden:
        obj = resolve(name)
        for member in (vars(obj).values() if isinstance(obj, type) else [obj]):
            member = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(member):
                found.append((name, member))
    return found


def forbidden_use(src: NotebookSource, expression: str, forbidden: tuple[str, ...]) -> str | None:
    """Why the answer is not the reader's own (None if its source uses nothing forbidden).

    forbidden: dotted paths of functions and classes that do the task; a class forbids its methods.
    """
    targets = {id(resolve(name)): name for name in forbidden if resolve(name) is not None}
    targets.update({id(fn): name for name, fn in forbidden_callables(forbidden)})
    for dotted in sorted(reached_names(src, expression)):
        if dotted.startswith(GRADER_PACKAGE) and dotted not in ALLOWED_GRADER_NAMES:
            return f"it uses {dotted}, which belongs to the grader"
        obj = resolve(dotted)
        key = id(getattr(obj, "__func__", obj))
        if obj is not None and key in targets:
            return f"it uses {dotted} ({targets[key]}), which already does the task"
    return None


# ---- copies: an answer that is the reference with its names changed ------------------------------

COPY_SIMILARITY = 0.9  # at or above this share of the reference's normalised code, an answer is flagged
COPY_MIN_TOKENS = 200  # ...if the reference is this long: a one-line formula is written alike by everyone


def normalised(function: ast.AST) -> list[str]:
    """A function's code with what a copier changes for free set aside, as a list of tokens: docstrings
    dropped, the function's own name and every parameter and local renamed by order of first appearance
    (`v0`, `v1`, ...). Globals, attributes, constants and the structure stay: they are what the code does."""
    function = ast.parse(ast.unparse(function)).body[0]  # a copy, its line numbers gone
    local = _local_names(function)
    for node in ast.walk(function):  # nested functions' locals too
        local |= _local_names(node)
    names: dict[str, str] = {}

    def rename(name: str) -> str:
        return names.setdefault(name, f"v{len(names)}")

    for node in ast.walk(function):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node.name = rename(node.name)
            if ast.get_docstring(node, clean=False) is not None:
                node.body = body[1:] or [ast.Pass()]
        if isinstance(node, ast.arg):
            node.arg, node.annotation = rename(node.arg), None
        elif isinstance(node, ast.Name) and node.id in local:
            node.id = rename(node.id)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
    return ast.dump(function, annotate_fields=False, include_attributes=False).replace("(", " ( ").split()


def similarity(a: list[str], b: list[str]) -> float:
    """The share of two token lists that matches (difflib's ratio: 1.0 for the same code)."""
    import difflib

    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def copied_from(src: NotebookSource, expression: str, forbidden: tuple[str, ...]) -> tuple[str, float] | None:
    """(the forbidden function, the similarity) when the answer's `def` is that function's code with names and
    docstrings changed (similarity >= COPY_SIMILARITY), else None. A review flag for the teacher, never a score:
    two honest answers to a small task can look alike, so references shorter than COPY_MIN_TOKENS are not
    compared at all."""
    import inspect
    import textwrap

    answers = [n for n in src.bindings.get(expression, []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not answers:
        return None
    mine = normalised(answers[-1])
    best: tuple[str, float] | None = None
    for name, fn in forbidden_callables(forbidden):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
        except (OSError, TypeError, SyntaxError):
            continue  # a builtin, or no source to compare
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        theirs = normalised(defs[0]) if defs else []
        if len(theirs) >= COPY_MIN_TOKENS:
            score = similarity(mine, theirs)
            if score >= COPY_SIMILARITY and (best is None or score > best[1]):
                best = (name, score)
    return best
