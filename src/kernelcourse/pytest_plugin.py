"""pytest plugin for the course's own test runs (enabled in pyproject.toml), over tests/ and the
nbval runs over notebooks/ and solutions/.

It picks the world before any test module imports triton or numba, and holds the course's promise to
readers without a GPU: on the CPU, a lesson notebook runs top to bottom within LESSON_CPU_LIMIT_S
seconds, or the session fails.
"""
from collections import defaultdict

from .world import setup, world

LESSON_CPU_LIMIT_S = 90
_lesson_seconds: dict[str, float] = defaultdict(float)


def pytest_configure(config):
    setup(quiet=True)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.startswith("notebooks/") and path.endswith(".ipynb"):
        _lesson_seconds[path] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if world().gpu or not _lesson_seconds:
        return
    for path, seconds in sorted(_lesson_seconds.items()):
        print(f"\n{path}: {seconds:.0f} s on the CPU (limit {LESSON_CPU_LIMIT_S} s)", end="")
    slow = [p for p, s in _lesson_seconds.items() if s > LESSON_CPU_LIMIT_S]
    if slow:
        print(f"\nLessons over the CPU time limit: {', '.join(sorted(slow))}")
        session.exitstatus = 1
