"""`minillm grade` against a class that tries to cheat, and the workflow a teacher runs it in.

Red team: each route a student might take to a grade they did not earn (issue 29) is tried in a class
folder beside an honest classmate. Every route either scores zero for the attacked task or carries a
review flag naming what it did; the honest classmate's notebook and grade are untouched; the
attacker's honestly solved task (00.rotary) still passes. These tests need bubblewrap (CI installs it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import nbformat
import pytest
import torch
from conftest import GRADER_IMPORTS
from conftest import OWN_ROPE as OWN_ROPE_ONLY

from minillm.book import load_book
from minillm.book.grading import TASKS, get_task
from minillm.book.grading.grade import grade_all
from minillm.book.grading.sandbox import Sandbox
from minillm.cli import main

IMPORTS = GRADER_IMPORTS
OWN_ROPE = OWN_ROPE_ONLY + "\ncheck('00.rotary', apply_rope)"
BLANK_RMS = "def rms_norm(x, weight, eps=1e-5):\n    raise NotImplementedError('write it')"


def write_notebook(path: Path, *sources: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nbformat.write(nb, path)
    return path


def attacks(bob: Path, hidden: Path) -> dict[str, list[str]]:
    """Each route's cells; `bob` is the honest classmate's notebook, `hidden` the instructor's hidden tests."""
    solutions = load_book().root / "solutions" / "00_the_model.ipynb"
    run_cells_of = ("import json\ndef run_cells_of(path):\n    nb = json.load(open(path))\n"
                    "    for cell in nb['cells']:\n        if cell['cell_type'] == 'code':\n"
                    "            exec(''.join(cell['source']), globals())\n")
    return {
        # C-level I/O, which the audit hook cannot see: ctypes' system(), torch's shared mmap, sqlite3
        "writes_through_c": [BLANK_RMS,
                             f"import ctypes\nctypes.CDLL(None).system(b'echo 0 > {bob}; echo hacked > /tmp/x')",
                             f"import torch\nt = torch.from_file('{bob}', shared=True, size=16, dtype=torch.uint8)\n"
                             "t.zero_()",
                             f"import sqlite3\nsqlite3.connect('{bob.parent}/grades.db').execute('create table t(x)')"],
        # the book's solution, found through the package's own path
        "execs_the_solution": [run_cells_of, f"run_cells_of('{solutions}')",
                               "import minillm, pathlib\nroot = pathlib.Path(minillm.__file__).parents[1]\n"
                               "run_cells_of(root / 'solutions' / '00_the_model.ipynb')"],
        # a classmate's notebook, by its path in the class folder
        "execs_a_classmate": [run_cells_of, f"run_cells_of('{bob}')"],
        # the hidden tests: their folder (from the grader's command line in /proc) and their source
        "reads_the_hidden_tests": [
            "import os, glob\nleak = []\nfor pid in os.listdir('/proc'):\n    try:\n"
            "        leak.append(open(f'/proc/{pid}/cmdline').read())\n    except Exception:\n        pass\n"
            f"for path in glob.glob('{hidden}/*.py'):\n    leak.append(open(path).read())",
            "def count_params(config):\n    raise ValueError(' | '.join(leak))"],
        # the grader's reference, its source exec'd under the task's name (a new code object)
        "execs_the_reference": [
            "import importlib, inspect\nmodule = importlib.import_module('minillm.book.grading.tasks.' + 'ch00')\n"
            "source = inspect.getsource(getattr(module, 'reference_' + 'rms_norm'))\nnamespace = dict(vars(module))\n"
            "exec(source.replace('reference_rms_norm', 'rms_norm'), namespace)\nrms_norm = namespace['rms_norm']"],
        # the engine's RMSNorm, with the grader's call watcher switched off first
        "switches_off_the_watcher": [
            "import importlib, sys\ndef rms_norm(x, weight, eps=1e-5):\n    sys.setprofile(None)\n"
            "    norm = getattr(importlib.import_module('minillm.' + 'model'), 'RMS' + 'Norm')(x.shape[-1], eps)\n"
            "    norm.weight.data = weight.float()\n    return norm.to(weight.dtype)(x)"],
        # the harness's answer function, found through gc and replaced by one that hands in the engine's
        "patches_the_harness": [
            BLANK_RMS,
            "import gc, importlib\nref = importlib.import_module('minillm.' + 'model')\n"
            "for o in gc.get_objects():\n"
            "    if isinstance(o, dict) and callable(o.get('_answer_call')) and callable(o.get('_call_watched')):\n"
            "        real = o['_answer_call']\n"
            "        def fake(request, namespace, real=real):\n"
            "            if request['answer'] == 'rms_norm':\n"
            "                norm = lambda x, w, eps=1e-5: ref.RMSNorm(x.shape[-1], eps)(x)\n"
            "                namespace = dict(namespace, rms_norm=norm)\n"
            "            return real(request, namespace)\n"
            "        o['_answer_call'] = fake\n"
            "        o['_call_watched'] = lambda fn, forbid: (*(lambda v: (v, None))(fn()), [])"],
    }


def test_every_route_to_an_unearned_grade_scores_zero_or_is_flagged(tmp_path, needs_bwrap):
    book = load_book()
    bob = tmp_path / "class" / "bob" / "00_the_model.ipynb"
    bob.parent.mkdir(parents=True)
    bob.write_bytes((book.root / "solutions" / "00_the_model.ipynb").read_bytes())
    bob_before = hashlib.sha256(bob.read_bytes()).hexdigest()
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "secret_test.py").write_text(
        "from minillm.book.grading import get_task\nfrom minillm.book.grading.tasks.ch00 import LLAMA_3_8B, "
        "reference_param_count\n\n@get_task('00.param_count').test('SECRET-HIDDEN-TEST-NAME')\n"
        "def _(fn):\n    assert fn(LLAMA_3_8B) == reference_param_count(LLAMA_3_8B)  # SECRET-HIDDEN-SOURCE-LINE\n")
    routes = attacks(bob, hidden)
    paths = [write_notebook(tmp_path / "class" / name / "00_the_model.ipynb", IMPORTS, OWN_ROPE, *cells)
             for name, cells in routes.items()]
    out_json = tmp_path / "grades.json"
    n_tests = len(get_task("00.param_count").tests)
    try:
        code = main(["grade", str(tmp_path / "class"), "-j", "2", "--extra-tests", str(hidden), "--json",
                     str(out_json), "--feedback", str(tmp_path / "feedback"), "--no-progress"])
    finally:
        del TASKS["00.param_count"].tests[n_tests:]
    assert code == 0
    assert len(paths) == len(routes)
    grades = {g["student"]: g for g in json.loads(out_json.read_text())}
    tasks = {name: {t["id"]: t for t in g["tasks"]} for name, g in grades.items()}

    # the honest classmate: file untouched, full marks, nothing to review
    assert hashlib.sha256(bob.read_bytes()).hexdigest() == bob_before
    assert not (bob.parent / "grades.db").exists() and not Path("/tmp/x").exists()
    assert grades["bob"]["score"] == grades["bob"]["max_score"] == 7, grades["bob"]
    assert not any(t["review"] for t in tasks["bob"].values())

    for name in routes:
        assert tasks[name]["00.rotary"]["score"] == 3, (name, tasks[name]["00.rotary"])  # the honest task counts
        rms, review = tasks[name]["00.rms_norm"], " ".join(tasks[name]["00.rms_norm"]["review"])
        assert rms["score"] == 0 or review, (name, rms)
    assert "ctypes" in " ".join(tasks["writes_through_c"]["00.rms_norm"]["review"])
    for name in ("execs_the_solution", "execs_a_classmate"):  # the files are not in the sandbox at all
        assert tasks[name]["00.rms_norm"]["score"] == 0
        assert "FileNotFoundError" in " ".join(grades[name]["notes"]), grades[name]["notes"]
    assert "calls exec()" in " ".join(tasks["execs_the_solution"]["00.rms_norm"]["review"])
    reference = tasks["execs_the_reference"]["00.rms_norm"]  # the task modules are not there to read
    assert reference["score"] == 0, reference
    assert "No module named 'minillm.book.grading.tasks.ch00'" in " ".join(grades["execs_the_reference"]["notes"])
    watcher = tasks["switches_off_the_watcher"]["00.rms_norm"]
    assert watcher["score"] == 0 and "profiler" in watcher["reason"], watcher
    harness = " ".join(tasks["patches_the_harness"]["00.rms_norm"]["review"])
    assert "gc" in harness and "searched the interpreter's objects" in harness, harness

    # the hidden tests: neither their folder nor their source reached the notebook, or anything a student sees
    record = out_json.read_text()
    assert str(hidden) not in record and "SECRET-HIDDEN-SOURCE-LINE" not in record
    leak = tasks["reads_the_hidden_tests"]["00.param_count"]
    assert leak["score"] == 0 and "ValueError" in leak["tests"][0]["message"]
    feedback = (tmp_path / "feedback" / "reads_the_hidden_tests.md").read_text()
    assert "SECRET-HIDDEN-TEST-NAME (a hidden test)" in feedback
    hidden_line = next(ln for ln in feedback.splitlines() if "SECRET-HIDDEN-TEST-NAME" in ln)
    assert hidden_line.startswith("- FAIL") and "ValueError" not in hidden_line


def test_a_cell_past_its_limit_is_interrupted_and_the_notebook_goes_on(tmp_path, needs_bwrap):
    """A Python loop is interrupted at the cell limit; a cell that blocks the interrupt is skipped in a re-run."""
    loops = write_notebook(tmp_path / "loops.ipynb", IMPORTS, "while True:\n    pass", OWN_ROPE)
    blocks = write_notebook(tmp_path / "blocks.ipynb", IMPORTS,
                            "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
                            "while True:\n    pass", OWN_ROPE)
    start = time.perf_counter()
    grades = grade_all([loops, blocks], jobs=2, progress=False, chapter_id="00", timeout_s=120, cell_timeout_s=2)
    assert time.perf_counter() - start < 90
    for g in grades:
        rotary = {t.id: t for t in g.tasks}["00.rotary"]
        assert rotary.passed, (g.student, rotary.reason, g.notes)
    notes = {g.student: " ".join(g.notes) for g in grades}
    assert "code cell 2: ran past its 2 s limit and was interrupted" in notes["loops"]
    assert "code cell 2: ran past its 2 s limit and could not be interrupted" in notes["blocks"]


def test_a_syntax_error_is_reported_with_its_line(tmp_path, needs_bwrap):
    path = write_notebook(tmp_path / "typo.ipynb", IMPORTS, OWN_ROPE, "def rms_norm(x, weight, eps=1e-5)\n    return x")
    grade = grade_all([path], progress=False, chapter_id="00", timeout_s=60)[0]
    rms = {t.id: t for t in grade.tasks}["00.rms_norm"]
    assert "code cell 3 has a syntax error (line 1: expected ':'" in rms.reason, rms.reason


def test_grade_refuses_without_bubblewrap_unless_told(tmp_path, monkeypatch, capsys):
    import minillm.book.grading.grade as grade_module
    import minillm.book.grading.sandbox as sandbox_module

    missing = f"bubblewrap (bwrap) is not installed: {sandbox_module.INSTALL_BWRAP}"
    monkeypatch.setattr(grade_module, "isolation_problem", lambda: missing)
    monkeypatch.setattr(sandbox_module, "isolation_problem", lambda: missing)
    path = write_notebook(tmp_path / "class" / "amy" / "00_the_model.ipynb", IMPORTS, OWN_ROPE)
    assert main(["grade", str(path), "--no-progress"]) == 1
    assert "apt-get install bubblewrap" in capsys.readouterr().err
    assert main(["grade", str(path), "--no-progress", "--no-sandbox", "--json", str(tmp_path / "g.json")]) == 0
    grade = json.loads((tmp_path / "g.json").read_text())[0]
    assert {t["id"]: t["score"] for t in grade["tasks"]}["00.rotary"] == 3


def test_the_teachers_workflow(tmp_path, needs_bwrap, capsys):
    """Chapter from the file name (warned on a mismatch), gradebook in book order with subtotals, points from
    the command line, feedback files, Canvas and Gradescope CSVs with a roster, and re-grading one student."""
    book = load_book()
    cls = tmp_path / "class"
    write_notebook(cls / "ann" / "00_the_model.ipynb", IMPORTS, OWN_ROPE)
    write_notebook(cls / "ben" / "00_the_model.ipynb", IMPORTS, OWN_ROPE,
                   "def rms_norm(x, weight, eps=1e-5):  # no eps\n    xf = x.float()\n"
                   "    return (xf / xf.pow(2).mean(-1, keepdim=True).sqrt()).to(x.dtype) * weight")
    (cls / "ann" / "01_decoding.ipynb").write_bytes((book.root / "solutions" / "01_decoding.ipynb").read_bytes())
    roster = tmp_path / "roster.csv"
    roster.write_text("student,name,email,sid,sis_user_id\nann,Ann Lee,ann@uni.edu,1001,S1\nben,Ben Ode,ben@uni.edu,"
                      "1002,S2\n")
    out = {name: tmp_path / name for name in ("grades.json", "grades.csv", "canvas.csv", "gradescope.csv")}
    args = ["grade", str(cls), "-j", "2", "--chapter", "01", "--points", "00.rotary=6", "--no-progress",
            "--json", str(out["grades.json"]), "--csv", str(out["grades.csv"]), "--canvas", str(out["canvas.csv"]),
            "--gradescope", str(out["gradescope.csv"]), "--roster", str(roster), "--feedback", str(tmp_path / "fb")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "00_the_model.ipynb is chapter 00's notebook, but --chapter 01 was given; graded as chapter 00" in err

    ch01 = book.chapter("01")
    rows = out["grades.csv"].read_text().splitlines()
    assert rows[0] == ",".join(["student", "00.param_count", "00.rms_norm", "00.rotary", "00 total", *ch01.tasks,
                                "01 total", "total", "max", "to review"])
    ann_max = 2 + 2 + 6 + sum(ch01.points.values())
    # ann's chapter 01 is the book's solution notebook: its beam_step is the reference's code, so it is flagged
    assert rows[1].startswith("ann,0.0,0.0,6.0,6.0,") and rows[1].endswith(f",{ann_max},1")
    beam = next(t for g in json.loads(out["grades.json"].read_text()) if g["student"] == "ann"
                for t in g["tasks"] if t["id"] == "01.beam_step")
    assert "the same code as minillm.decoding.beam.beam_step" in " ".join(beam["review"]), beam["review"]
    assert rows[2].startswith("ben,0.0,1.5,6.0,7.5," + "," * len(ch01.tasks) + ",7.5,")  # no chapter 01 from ben

    canvas = out["canvas.csv"].read_text().splitlines()
    assert canvas[0] == ("Student,ID,SIS User ID,SIS Login ID,Section,minillm 00: " + book.chapter("00").title +
                         ",minillm 01: " + ch01.title)
    assert canvas[1] == f"Points Possible,,,,,10.0,{sum(ch01.points.values())}"
    assert canvas[2] == f"Ann Lee,,S1,ann,,6.0,{sum(ch01.points.values())}"
    assert out["gradescope.csv"].read_text().splitlines()[2] == "Ben Ode,1002,ben@uni.edu,7.5,"

    feedback = (tmp_path / "fb" / "ben.md").read_text()
    assert "## Chapter 00: 7.5 / 10 points" in feedback and "- FAIL:" in feedback and "hint:" in feedback

    # ben fixes his notebook; re-grade him alone into the same gradebook
    write_notebook(cls / "ben" / "00_the_model.ipynb", IMPORTS, OWN_ROPE,
                   "def rms_norm(x, weight, eps=1e-5):\n    xf = x.float()\n"
                   "    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight")
    assert main(["grade", str(cls / "ben"), "--no-progress", "--update", str(out["grades.json"]), "--csv",
                 str(out["grades.csv"])]) == 0
    grades = json.loads(out["grades.json"].read_text())
    assert sorted((g["student"], g["chapter"]) for g in grades) == [("ann", "00"), ("ann", "01"), ("ben", "00")]
    ben = next(g for g in grades if g["student"] == "ben")
    assert {t["id"]: t["score"] for t in ben["tasks"]} == {"00.param_count": 0, "00.rms_norm": 2, "00.rotary": 3}
    assert out["grades.csv"].read_text().splitlines()[2].startswith("ben,0.0,2.0,3.0,5.0,")


@pytest.mark.parametrize("bad, message", [
    (["--points", "00.rotary"], "expected TASK=POINTS"),
    (["--points", "00.nope=3"], "no exercise task '00.nope'"),
    (["--points", "00.rotary=-1"], "must be >= 0"),
])
def test_bad_points_are_one_line_errors(tmp_path, bad, message, capsys):
    path = write_notebook(tmp_path / "x.ipynb", IMPORTS)
    assert main(["grade", str(path), "--no-progress", "--no-sandbox", *bad]) == 1
    assert message in capsys.readouterr().err


def test_the_sandbox_sees_no_class_folder_solutions_or_grader(tmp_path, needs_bwrap):
    """What the notebook's process can see: its home, the package; not the checkout around it, nor the grader."""
    import minillm

    root = Path(minillm.__file__).resolve().parents[1]
    probe = write_notebook(tmp_path / "class" / "eve" / "probe.ipynb",
                           "import os, json\nseen = json.dumps({'cwd': os.getcwd(), 'uid': os.getuid(), "
                           f"'root': sorted(os.listdir({str(root)!r})), 'pids': sorted(p for p in os.listdir('/proc') "
                           "if p.isdigit()), 'class': os.path.exists(" + repr(str(tmp_path / "class")) + ")})",
                           "def count_params(config):\n    return seen")
    with Sandbox(probe, timeout_s=60) as sandbox:
        sandbox.start()
        seen = json.loads(sandbox.call("count_params", (None,), {}, (), time.monotonic() + 30)[0])
    assert seen["cwd"] == "/home/student" and seen["uid"] == 65534
    assert "solutions" not in seen["root"] and "minillm" in seen["root"]
    assert seen["class"] is False and len(seen["pids"]) <= 3, seen


def test_the_call_watcher_knows_a_call_and_a_renamed_copy_by_what_its_code_does(monkeypatch):
    """A forbidden function's source exec'd under another name is a new code object; its fingerprint matches, and
    it is a copy (a review flag) where a call of the library's own function is a call (no credit); a copy of a
    one-line formula is neither (everyone writes it alike)."""
    import inspect

    import minillm.book.grading.sandbox as sandbox_module
    from minillm import arithmetic
    from minillm.book.grading.sandbox import COPY_MIN_STEPS, _call_watched, code_fingerprint, watch_list
    from minillm.sampler import sampling

    flags: list[str] = []
    monkeypatch.setattr(sandbox_module, "raise_flag", flags.append)
    assert len(code_fingerprint(sampling.top_p_filter.__code__)[0]) >= COPY_MIN_STEPS
    namespace: dict = dict(vars(sampling))  # the globals the copied source reads
    exec(inspect.getsource(sampling.top_p_filter).replace("def top_p_filter", "def mine"), namespace)  # noqa: S102
    logits, watch = torch.randn(2, 9), watch_list(("minillm.sampler.sampling.top_p_filter",))
    value, error, hits = _call_watched(lambda: namespace["mine"](logits, 0.5), watch)
    assert error is None and hits == [] and torch.equal(value, sampling.top_p_filter(logits, 0.5))
    copies = [f for f in flags if f.startswith("ran a copy")]  # (threads other tests left running flag too)
    assert copies == ["ran a copy of minillm.sampler.sampling.top_p_filter: the same instructions once names and "
                      "docstrings are set aside"]
    assert _call_watched(lambda: sampling.top_p_filter(logits, 0.5), watch)[2] == [
        "minillm.sampler.sampling.top_p_filter"]
    exec(inspect.getsource(arithmetic.cdiv).replace("def cdiv", "def my_ceiling"), namespace)  # noqa: S102
    flags.clear()
    value, error, hits = _call_watched(lambda: namespace["my_ceiling"](7, 2), watch_list(("minillm.arithmetic.cdiv",)))
    assert (value, error, hits) == (4, None, []) and not [f for f in flags if f.startswith("ran a copy")]


def test_python_under_tmp_stays_visible_in_the_sandbox(monkeypatch):
    """A checkout in /tmp has its .venv there: the sandbox's empty /tmp must be mounted before Python's folders, or it
    hides them (bwrap mounts in order) and every sandboxed test skips with 'execvp ... No such file'."""
    import minillm.book.grading.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "readonly_paths", lambda: ["/tmp/ci/.venv", "/opt/python"])
    args = sandbox_module.bwrap_command()
    tmpfs = args.index("--tmpfs")
    assert args[tmpfs + 1] == "/tmp"
    binds = [i for i, a in enumerate(args) if a == "--ro-bind" and args[i + 1] in ("/tmp/ci/.venv", "/opt/python")]
    assert len(binds) == 2 and all(i > tmpfs for i in binds), args
    home = len(args) - 1 - args[::-1].index("--tmpfs")
    assert args[home + 1] == sandbox_module.SANDBOX_HOME and args[home - 4: home - 2] == ["--size", str(2**29)]


def test_the_notebooks_files_are_capped_in_a_home_of_their_own(tmp_path, needs_bwrap):
    """The sandbox's home is a tmpfs of `disk_bytes`, not a folder on the host's disk: small files work, and a
    notebook that writes more than the cap gets "no space left" rather than filling the machine."""
    path = write_notebook(tmp_path / "n.ipynb", "import os\nopen('small', 'wb').write(b'x' * 2**20)\n"
                          "try:\n    open('big', 'wb').write(b'x' * 2**25)\n    outcome = 'written'\n"
                          "except OSError as e:\n    outcome = os.strerror(e.errno)\n"
                          "def report(_):\n    return [outcome, os.path.getsize('small'), os.getcwd()]")
    with Sandbox(path, timeout_s=120, disk_bytes=2**24) as sandbox:
        sandbox.start()
        value, _ = sandbox.call("report", (0,), {}, (), time.monotonic() + 30)
    assert value == ["No space left on device", 2**20, "/home/student"], value


def test_memory_outside_the_address_space_is_refused(tmp_path, needs_bwrap):
    """memfd_create holds memory that RLIMIT_AS never sees (write to it, never map it): the sandbox's seccomp filter
    refuses it, whichever way it is called, and the notebook goes on."""
    path = write_notebook(tmp_path / "n.ipynb", "import os, ctypes\nseen = []\nlibc = ctypes.CDLL(None)\n"
                          "for make in (lambda: os.memfd_create('x'), lambda: libc.memfd_create(b'x', 0)):\n"
                          "    try:\n        seen.append(make())\n    except OSError as e:\n"
                          "        seen.append(os.strerror(e.errno))\n"
                          "seen[1] = seen[1] if seen[1] >= 0 else os.strerror(ctypes.get_errno() or 1)\n"
                          "def report(_):\n    return seen")
    with Sandbox(path, timeout_s=120) as sandbox:
        sandbox.start()
        value, _ = sandbox.call("report", (0,), {}, (), time.monotonic() + 30)
    assert value == ["Operation not permitted", "Operation not permitted"], value


def test_where_systemd_and_cgroup_v2_are_there_each_sandbox_gets_a_memory_scope(tmp_path, monkeypatch):
    """With `systemd-run` on a cgroup v2 machine the sandbox runs in a scope of its own with MemoryMax (every page
    counted); without them `minillm grade` says what bounds memory instead. A stand-in systemd-run records how it
    was called and runs the command after `--`."""
    import minillm.book.grading.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "CGROUP_V2", tmp_path / "missing")
    sandbox_module.memory_scope.cache_clear()
    assert sandbox_module.memory_scope() is None
    assert "no cgroup v2 scope here" in sandbox_module.memory_cap() and "memfd_create" in sandbox_module.memory_cap()

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    fake = bin_dir / "systemd-run"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nwhile [ "$#" -gt 0 ] && [ "$1" != "--" ]; do\n'
                    '  [ "$1" = true ] && exit 0\n  shift\ndone\nshift\nexec "$@"\n')
    fake.chmod(0o755)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(sandbox_module, "CGROUP_V2", tmp_path / "cgroup.controllers")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(sandbox_module, "isolation_problem", lambda: None)
    sandbox_module.memory_scope.cache_clear()
    try:
        assert sandbox_module.memory_scope() is not None and "MemoryMax 5 GiB" in sandbox_module.memory_cap()
        path = write_notebook(tmp_path / "n.ipynb", "def answer(x):\n    return x + 1")
        with Sandbox(path, timeout_s=120, memory_bytes=2**31) as sandbox:
            if shutil.which("bwrap") is None:
                pytest.skip("needs bubblewrap to start the sandbox itself")
            sandbox.start()
            assert sandbox.call("answer", (1,), {}, (), time.monotonic() + 30)[0] == 2
    finally:
        sandbox_module.memory_scope.cache_clear()
    calls = log.read_text().splitlines()
    assert any(f"MemoryMax={2**31 + sandbox_module.MEMORY_BASELINE_BYTES} -p MemorySwapMax=0 -- bwrap" in c
               for c in calls), calls
