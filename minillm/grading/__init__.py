"""Auto-checked exercises, the grade command and the interview drill bank (every chapter).

    from minillm.grading import check, drill, load_drills
    check("00.rms_norm", rms_norm)
    load_drills(chapter="02", level="expert")
"""

from minillm.grading.check import TASKS, MismatchError, TaskResult, check, get_task, register_task, run_task
from minillm.grading.drills import Drill, drill, get_drill, load_drills

__all__ = ["TASKS", "Drill", "MismatchError", "TaskResult", "check", "drill", "get_drill", "get_task", "load_drills",
           "register_task", "run_task"]
