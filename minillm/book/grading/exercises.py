"""Exercise notebooks generated from solution notebooks (`minillm book exercises`).

A solution notebook marks each answer with a region inside a function body:

    def rms_norm(x, weight, eps=1e-5):
        # BEGIN SOLUTION: divide x by its root mean square over the last axis, then scale by weight
        ...answer...
        # END SOLUTION

A hint longer than a line goes on in comment lines right after the BEGIN line, indented three spaces
after the `#` (`#   ...more of the hint`), so that no line passes the book's 120 characters.

`make_exercise` replaces each region by `raise NotImplementedError("<the text after the colon>")`
at the region's indentation (its message cut into strings on several lines where one line would pass
120 characters), and clears every output, so the exercise notebook is the solution
with the answers taken out (and without `# NBVAL_CHECK_OUTPUT` markers: it has no outputs to
compare). Regions must be indented (inside a function): a blanked answer then
fails only when the reader's `check(...)` calls it, and the notebook still runs top to bottom.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?::\s*(?P<what>.*?))?\s*$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
DEFAULT_WHAT = "write this part (see the task description above)"
LINE_LENGTH = 120  # the project's (ruff) and the web book's code width
GENERATED_NOTE = (
    "*This exercise notebook is generated from `{solution}` by `minillm book exercises`: edit the solution, "
    "not this file. Replace each `raise NotImplementedError(...)` with your code, then run the `check` cell "
    "below it.*"
)


class ExerciseError(ValueError):
    """A solution notebook whose SOLUTION markers cannot be turned into an exercise."""


def blank_source(source: str, where: str = "cell") -> tuple[str, int]:
    """Replace every BEGIN/END SOLUTION region of one cell's source; returns (new source, regions)."""
    out: list[str] = []
    lines = source.split("\n")
    i, regions = 0, 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if END.match(lines[i]):
            raise ExerciseError(f"{where}, line {i + 1}: '# END SOLUTION' without a '# BEGIN SOLUTION' before it.")
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent = m.group("indent")
        if not indent:
            raise ExerciseError(
                f"{where}, line {i + 1}: a SOLUTION region must be indented inside a function body, so that the "
                "blanked exercise still runs top to bottom; wrap the answer in a function."
            )
        j = i + 1
        while j < len(lines) and not END.match(lines[j]):
            if BEGIN.match(lines[j]):
                raise ExerciseError(f"{where}, line {j + 1}: SOLUTION regions cannot nest.")
            j += 1
        if j == len(lines):
            raise ExerciseError(f"{where}, line {i + 1}: '# BEGIN SOLUTION' has no '# END SOLUTION' after it.")
        what = m.group("what") or DEFAULT_WHAT
        for line in lines[i + 1: j]:  # the hint's continuation lines, "#   more of it"
            if not line.startswith(f"{indent}#   "):
                break
            what += " " + line[len(indent) + 1:].strip()
        out.extend(raise_lines(indent, what))
        regions += 1
        i = j + 1
    return "\n".join(out), regions


def raise_lines(indent: str, what: str, width: int = LINE_LENGTH) -> list[str]:
    """`raise NotImplementedError("<what>")` at `indent`; where that passes `width` characters, the message
    is cut at spaces into strings that Python joins, one per line, aligned under the first."""
    head = f"{indent}raise NotImplementedError("
    if len(f"{head}{what!r})") <= width:
        return [f"{head}{what!r})"]
    pieces, piece = [], ""
    for word in what.split(" "):
        if piece and len(head) + len(repr(f"{piece} {word} ")) + 1 > width:
            pieces.append(piece + " ")
            piece = word
        else:
            piece = f"{piece} {word}" if piece else word
    pieces.append(piece)
    return [f"{head if k == 0 else ' ' * len(head)}{p!r}{')' if k == len(pieces) - 1 else ''}"
            for k, p in enumerate(pieces)]


def make_exercise(solution_path: str | Path, solution_name: str | None = None) -> nbformat.NotebookNode:
    """The exercise notebook for a solution notebook: answers blanked, outputs cleared, a note on top."""
    solution_path = Path(solution_path)
    nb = nbformat.read(solution_path, as_version=4)
    total = 0
    for index, cell in enumerate(nb.cells):
        cell.pop("id", None)
        if cell.cell_type != "code":
            continue
        source, regions = blank_source(cell.source, f"{solution_path.name}, cell {index}")
        # The solution's checked outputs are the answers' outputs: the blank exercise has none to compare.
        cell.source = "\n".join(ln for ln in source.split("\n") if ln.strip() != "# NBVAL_CHECK_OUTPUT")
        total += regions
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
    if total == 0:
        raise ExerciseError(f"{solution_path} has no '# BEGIN SOLUTION' regions: nothing to turn into an exercise.")
    note = nbformat.v4.new_markdown_cell(GENERATED_NOTE.format(solution=solution_name or solution_path.name))
    nb.cells.insert(0, note)
    for index, cell in enumerate(nb.cells):  # stable ids, so regenerating gives the same file
        cell["id"] = f"cell-{index}"
    nb.metadata.pop("widgets", None)
    return nb


def exercise_text(solution_path: str | Path, solution_name: str | None = None) -> str:
    """The exercise notebook as the exact text `write_exercises` writes (used by the sync test)."""
    return nbformat.writes(make_exercise(solution_path, solution_name)) + "\n"


def write_exercises(book_path: str | Path | None = None) -> list[Path]:
    """Regenerate the exercise notebook of every written chapter from its solution; returns the paths."""
    from minillm.book import load_book

    book = load_book(book_path)
    written = []
    for chapter in book.written():
        solution, exercise = book.root / chapter.solution, book.root / chapter.exercise
        if not solution.is_file():
            raise ExerciseError(f"chapter {chapter.id}: its solution notebook {chapter.solution} does not exist.")
        exercise.parent.mkdir(parents=True, exist_ok=True)
        exercise.write_text(exercise_text(solution, chapter.solution), encoding="utf-8")
        written.append(exercise)
    return written
