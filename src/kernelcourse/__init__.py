"""Helpers for the GPU kernels course.

``import kernelcourse as kc`` is cheap and imports neither triton nor numba: ``kc.setup()`` must pick
the world (a real GPU, or Triton's interpreter and numba's CUDA simulator) before either is imported.
Submodules load on first use: ``kc.bench``, ``kc.grading``, ``kc.plots``, ``kc.cuda_cpp``,
``kc.roofline`` (chapter 02), ``kc.ledger`` (chapter 03), ``kc.kernels`` (chapters 04-05),
``kc.attention`` (chapter 06), ``kc.attention_backward`` (chapter 07),
``kc.transformer`` and ``kc.losses`` (chapter 08), ``kc.hf`` (chapter 09), ``kc.targets`` (what a kernel
compiles to on each GPU, chapter 05).

A tour, from the bottom up; each module imports only modules listed before it
(tests/test_imports.py checks it, layer by layer):

- ``world``: which machine this is (GPU or CPU), ``setup()``, versions. ``bench``: timing, and the
  GPU results recorded for readers without one. ``plots``: the lessons' shared figures. ``launch``: a
  compiled Triton kernel launched directly, for the lean launchers (chapter 09; ``KC_DIRECT_LAUNCH=1``).
- ``cuda_cpp`` (CUDA C++, chapter 01), ``roofline``, ``ledger``, ``targets``: tools a lesson uses.
- ``kernels``, ``attention``, ``attention_backward``, ``transformer``, ``losses``: the course's finished
  kernels, one module per chapter, each a reference for the lesson that builds it, and each one a
  PyTorch operator (``torch.ops.kernelcourse``). ``hf``: the course's attention inside a Hugging Face model.
- ``grading``: the exercises' graders, ``grading/chNN.py`` per chapter over one ``grading/harness.py``
  (see ``grading``'s own tour). ``grade``: the command ``python -m kernelcourse.grade`` that runs
  exercise notebooks and prints the table. ``pytest_plugin``: picks the world for the course's tests.
"""
import importlib

from .world import World, setup, world

__version__ = "0.1.0"
__all__ = ["World", "setup", "world", "attention", "attention_backward", "bench", "cuda_cpp", "grading", "hf", "kernels", "launch", "ledger", "losses", "plots", "roofline", "targets", "transformer"]

_LAZY = {"attention", "attention_backward", "bench", "cuda_cpp", "grading", "hf", "kernels", "launch", "ledger", "losses", "plots", "roofline", "targets", "transformer"}


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kernelcourse' has no attribute {name!r}")
