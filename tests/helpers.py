"""Running a grader from a test: did it pass, and what did it print? The environment of a child
process that runs the course's commands, and the GPU properties Triton reports, to stand in for a GPU."""
import contextlib
import io
import os
from pathlib import Path

import kernelcourse as kc

# What Triton's get_device_properties reports as shared memory per block: 64 KB on a T4, 227 KB on an H100.
T4 = {"max_shared_mem": 65536, "multiprocessor_count": 40}
H100 = {"max_shared_mem": 232448, "multiprocessor_count": 132}


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


def env_importing(src: Path) -> dict:
    """This process's environment for a child Python that imports kernelcourse from ``src``: ``src``
    goes first on PYTHONPATH, whatever the caller's PYTHONPATH already holds stays after it."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
