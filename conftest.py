"""pytest configuration shared by tests/ and the nbval runs over notebooks/ and solutions/.

The world is picked before any test module imports triton or numba. On the CPU, a lesson notebook
must run top to bottom within LESSON_CPU_LIMIT_S seconds (the course's promise to readers without a
GPU); the session fails if one does not.
"""
from collections import defaultdict
from pathlib import Path

import kernelcourse as kc

kc.setup(quiet=True)

LESSON_CPU_LIMIT_S = 90
_lesson_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.startswith("notebooks/") and path.endswith(".ipynb"):
        _lesson_seconds[path] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if kc.world().gpu:
        return
    slow = {p: s for p, s in _lesson_seconds.items() if s > LESSON_CPU_LIMIT_S}
    for path, seconds in sorted(_lesson_seconds.items()):
        print(f"\n{path}: {seconds:.0f} s on the CPU (limit {LESSON_CPU_LIMIT_S} s)", end="")
    if slow:
        print(f"\nLessons over the CPU time limit: {', '.join(slow)}")
        session.exitstatus = 1
