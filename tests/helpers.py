"""Running a grader from a test: did it pass, and what did it print?"""
import contextlib
import io

import kernelcourse as kc


def grade(exercise_id: str, **objects) -> tuple[bool, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            kc.grading.check(exercise_id, objects)
            passed = True
        except kc.grading.GradeFailure:
            passed = False
    return passed, out.getvalue()


def memorised(correct, default=1):
    """A correct function that records its answers, and a table of them that answers nothing else
    (``default`` for a question it has not seen): what a learner who copied a run's answers submits."""
    table = {}

    def recording(*args):
        table[args] = correct(*args)
        return table[args]

    return recording, lambda *args: table.get(args, default)
