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
