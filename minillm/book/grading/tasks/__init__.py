"""Every chapter's exercise tasks; importing this package registers them all in `grading.registry`.

`grading.check` imports it on first use; the task modules import only the registry, never `check`.
"""

from minillm.book.grading.tasks import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09  # noqa: F401 - importing registers the NN.* tasks
