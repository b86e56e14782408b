"""Auto-checked exercises, the grade command and the interview drill bank (every chapter).

    from minillm.grading import check
    check("00.rms_norm", rms_norm)
"""

from minillm.grading.check import TASKS, MismatchError, TaskResult, check, get_task, register_task, run_task

__all__ = ["TASKS", "MismatchError", "TaskResult", "check", "get_task", "register_task", "run_task"]
