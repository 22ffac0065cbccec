"""What one call of the course's attention costs the CPU and the GPU, against SDPA's flash backend.

    PYTHONPATH=src python tools/launch_cost.py            # on a CUDA GPU

For each case, forward alone and forward + backward, in float16: the CPU's microseconds per call (300 calls
issued back to back after a warm-up, no synchronisation: the time Python and the launches take), the GPU's
microseconds per call (``kc.bench.gpu_time``: the calls replayed in a CUDA graph, no CPU work between them)
and ``do_bench``'s milliseconds (a call as a program makes it: whichever of the two is longer shows).
The course runs ``kc.attention_backward.attention`` (the lean launchers), twice: launched through
Triton, and with ``kernelcourse.launch``'s direct launch switched on (``course, direct``); SDPA runs under
``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

import kernelcourse as kc

CASES = [((8, 12, 1024, 64), True), ((32, 16, 512, 64), False), ((16, 12, 256, 64), False),
         ((4, 16, 4096, 64), True), ((4, 16, 4096, 64), False)]
CALLS = 300


def sdpa_flash(q, k, v, causal):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def calls(attend, q, k, v, do, causal):
    """(forward, forward + backward) of one implementation, as functions of no argument."""
    def fwd():
        with torch.no_grad():
            attend(q, k, v, causal)

    def fwd_bwd():
        torch.autograd.grad(attend(q, k, v, causal), (q, k, v), do)

    return fwd, fwd_bwd


def main():
    w = kc.setup(quiet=True)
    if not w.gpu:
        raise SystemExit("launch_cost.py measures a GPU: run it on a machine with CUDA")
    from kernelcourse import launch
    from kernelcourse.attention_backward import attention

    course = lambda q, k, v, causal: attention(q, k, v, causal=causal)  # noqa: E731
    # the course twice: launched through Triton, then with the direct launch (kernelcourse.launch) switched
    # on, in this run whatever KC_DIRECT_LAUNCH says
    impls = {"course": (course, False), "course, direct": (course, True), "SDPA flash": (sdpa_flash, False)}
    enabled = launch.ENABLED
    rows = []
    for (B, H, N, d), causal in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for name, (attend, direct) in impls.items():
            launch.ENABLED = direct
            for what, fn in zip(("fwd", "fwd+bwd"), calls(attend, q, k, v, do, causal)):
                fn()                                     # compiles and tunes
                rows.append({"case": f"({B},{H},{N},{d}){' causal' if causal else ''}", "pass": what, "impl": name,
                             "cpu us": kc.bench.cpu_time_per_call(fn, calls=CALLS, warmup=10), "gpu us": kc.bench.gpu_time(fn) * 1e3,
                             "do_bench ms": kc.bench.do_bench(fn)})
    launch.ENABLED = enabled
    print(kc.bench.table(rows, {"case": "", "pass": "", "impl": "", "cpu us": ".0f", "gpu us": ".0f",
                                "do_bench ms": ".3f"}))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {kc.world().versions.get('triton')}")


if __name__ == "__main__":
    main()
