"""Auto-checked exercises, the grade command and the interview drill bank (every chapter).

    from minillm.book.grading import check, drill, load_drills
    check("00.rms_norm", rms_norm)
    load_drills(chapter="02", level="expert")

The imports inside point one way: the chapters' task modules (`tasks/`) register into `registry`;
`check` imports them to fill it and runs their tests; `grade` and `sandbox` build on `check`.
"""

from minillm.book.grading.check import TaskResult, check, get_task, run_task
from minillm.book.grading.drills import Drill, drill, get_drill, load_drills
from minillm.book.grading.registry import TASKS, MismatchError, register_task

__all__ = ["TASKS", "Drill", "MismatchError", "TaskResult", "check", "drill", "get_drill", "get_task", "load_drills",
           "register_task", "run_task"]
