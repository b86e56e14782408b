"""Every chapter's exercise tasks; importing this package registers them all (see `grading.check`)."""

from minillm.grading.tasks import ch00  # noqa: F401 - registers the 00.* tasks
