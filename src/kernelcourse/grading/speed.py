"""Speed checks (introduced in chapter 01), made on a GPU only: the learner's code timed now, in this
process, against a peer or against a copy moving as many bytes. On the CPU they are reported as not
graded, never as passed.
"""
from __future__ import annotations

from .. import bench
from ..world import pre_hopper_emulation, world
from .reporting import Report
from .running import guarded



def _median_ms(report: Report, what: str, fn, gpu_only: bool = False) -> float | None:
    """Median time of learner (or peer) code in ms on this GPU, or None after recording why it failed:
    as a program calls it (``bench.do_bench``), or its kernels' time alone (``bench.gpu_time``)."""
    before = report.failures
    ms = guarded(report, what, bench.gpu_time if gpu_only else bench.do_bench, fn)
    return None if report.failures > before else ms


def speed_vs_peer(report: Report, what: str, fn, peer, peer_name: str, at_least: float,
                  hint: str | None = None, library_peer: bool = False, gpu_only: bool = False) -> bool | None:
    """Speed check on a GPU: ``fn()`` must run at least ``at_least`` times as fast as ``peer()``, both
    timed now, in this process (median of many runs). On the CPU the check is not graded. ``hint``
    follows a failing line: what makes a correct kernel this slow.

    ``library_peer``: the peer is library code on tensor cores (cuBLAS, SDPA), which Triton's
    ``DISABLE_MMA_V3`` does not reach. Under ``tools/gpu_check.py --pre-hopper`` (or ``--as-t4``) on a Hopper
    GPU (``world.pre_hopper_emulation``) the learner's Triton kernel is held to mma.sync while such a peer
    runs as built for Hopper, so a shortfall says nothing about any GPU: it is reported as not graded, with
    the times and the reason. A kernel fast enough even so passes, as it would with both on one path (the
    emulation only slows the learner's side). On an A100, an L4 or a T4 both sides run that GPU's own code,
    and the check is graded as ever; a peer that Triton compiles follows the flag too and is always graded.

    ``gpu_only``: time the kernels that each call launches, on the GPU alone (``bench.gpu_time``: a CUDA
    graph, no Python between them), where the check is about what a kernel does with memory and a launcher
    of a few small launches and allocations would otherwise time the CPU: a second process on the machine
    (another notebook, a compile) slows Python, never the kernels.

    Returns True or False when graded, None when not.
    """
    if not world().gpu:
        report.not_graded(f"{what}: speed needs a GPU (not graded here)")
        return None
    ms, peer_ms = _median_ms(report, what, fn, gpu_only), _median_ms(report, peer_name, peer, gpu_only)
    if ms is None or peer_ms is None:
        return False
    ratio = peer_ms / ms
    if ratio < at_least and library_peer and (held_back := pre_hopper_emulation()):
        report.not_graded(f"{what}: {ratio:.2f}x the speed of {peer_name} ({ms:.3f} ms vs {peer_ms:.3f} ms; needs "
                          f"{at_least:g}x), not graded here: {held_back}, so the ratio is neither this GPU's nor an "
                          f"older one's, where both sides run that GPU's own code")
        return None
    failed = (f"{what}: {ratio:.2f}x the speed of {peer_name} ({ms:.3f} ms vs {peer_ms:.3f} ms); needs at least "
              f"{at_least:g}x")
    return report.expect(
        ratio >= at_least,
        f"{what}: {ratio:.2f}x the speed of {peer_name} ({ms:.3f} ms vs {peer_ms:.3f} ms; needs {at_least:g}x)",
        f"{failed}: {hint}" if hint else failed,
    )


def speed_vs_roof(report: Report, what: str, fn, nbytes: float, at_least: float) -> bool | None:
    """Speed check on a GPU against the memory roof: ``fn()``, which must move ``nbytes`` bytes (reads
    plus writes), against a device-to-device copy moving as many bytes, timed now. Passes when the
    copy's time over ``fn``'s is at least ``at_least``. On the CPU the check is not graded.
    """
    import torch

    if not world().gpu:
        report.not_graded(f"{what}: speed needs a GPU (not graded here)")
        return None
    half = max(int(nbytes) // 2, 1)  # a copy reads and writes each byte once
    src = torch.randint(0, 256, (half,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, copy_ms = _median_ms(report, what, fn), _median_ms(report, "copy", lambda: dst.copy_(src))
    if ms is None or copy_ms is None:
        return False
    gbs = nbytes / (ms * 1e-3) / 1e9
    fraction = copy_ms / ms
    return report.expect(
        fraction >= at_least,
        f"{what}: {gbs:.0f} GB/s, {fraction:.0%} of a copy's bandwidth measured now (needs {at_least:.0%})",
        f"{what}: {gbs:.0f} GB/s, {fraction:.0%} of a copy's bandwidth measured now; needs at least "
        f"{at_least:.0%}: is each element read once, and are loads and stores contiguous?",
    )
