"""kc.ledger: the bytes each aten op reads and writes, from the real tensors (chapter 03)."""
import pytest
import torch
import torch.nn.functional as F

import kernelcourse as kc

L = kc.ledger
DEVICES = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])


def rows(led, kind=None):
    return [r for r in led.rows if kind is None or r.kind == kind]


def work(led):
    return [r for r in led.rows if r.kind not in ("view", "alloc")]


# ---- elementwise chains ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_elementwise_chain_matches_the_k_rule(device):
    x = torch.randn(37, 129, device=device)
    led = L.measure(lambda x: torch.tanh(F.gelu(x * 0.5) + 1.0), x)
    assert [r.name for r in led.rows] == ["mul.Tensor", "gelu", "add.Tensor", "tanh"]
    assert led.total == L.chain_bytes(x.numel(), 4, 4, fused=False)
    assert led.fused_bytes() == L.chain_bytes(x.numel(), 4, 4, fused=True)
    assert led.kernels == 4
    for r in led.rows:
        assert r.bytes_read == r.bytes_written == x.numel() * 4


def test_chain_bytes():
    assert L.chain_bytes(1000, 3, 2, fused=False) == 12_000
    assert L.chain_bytes(1000, 3, 2, fused=True) == 4_000
    with pytest.raises(ValueError):
        L.chain_bytes(1000, 0, 2, fused=True)


def test_broadcast_bias_is_read_once():
    x, b = torch.randn(64, 300), torch.randn(300)
    led = L.measure(lambda x, b: F.gelu(x + b), x, b)
    add = led.rows[0]
    assert add.bytes_read == (64 * 300 + 300) * 4 and add.bytes_written == 64 * 300 * 4
    assert led.fused_bytes() == (2 * 64 * 300 + 300) * 4


def test_same_tensor_twice_is_read_once():
    x = torch.randn(1000)
    led = L.measure(lambda x: x * x, x)
    assert led.rows[0].bytes_read == 4000 and led.rows[0].bytes_written == 4000


# ---- views and strides -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_views_move_nothing(device):
    x = torch.randn(8, 16, device=device)

    def views(x):
        return (x.view(128), x.t(), x.expand(3, 8, 16), x.as_strided((4, 4), (16, 1)), x.detach(),
                x.permute(1, 0), x[2:5], x.unsqueeze(0), x.reshape(2, 64))

    led = L.measure(views, x)
    assert led.rows and all(r.kind == "view" for r in led.rows), led.table()
    assert led.total == 0 and led.kernels == 0
    assert led.fused_bytes() == 0  # returning views of the input writes nothing


def test_unsafe_view_from_matmul_is_a_view():
    led = L.measure(torch.matmul, torch.randn(2, 4, 8), torch.randn(8, 3))
    assert [r.name for r in led.rows] == ["view", "mm", "_unsafe_view"]
    assert [r.kind for r in led.rows] == ["view", "", "view"]


def test_strided_inputs_count_the_storage_they_reach():
    x = torch.randn(64, 100)
    assert L.footprint(x[:, :10]) == 64 * 10 * 4          # a slice: only its elements
    assert L.footprint(x.t()) == x.numel() * 4             # a transpose: all of them, once
    assert L.footprint(x[:, :1].expand(64, 100)) == 64 * 4  # stride 0: the repeats are free
    windows = torch.arange(10.0).as_strided((8, 3), (1, 1))  # overlapping windows
    assert L.footprint(windows) == 10 * 4
    assert L.footprint(x[::2]) == 32 * 100 * 4
    assert L.footprint(torch.empty(0, 5)) == 0
    led = L.measure(lambda x: x[:, :10] * 2, x)
    assert work(led)[0].bytes_read == 64 * 10 * 4
    led = L.measure(lambda x: x.t().contiguous(), x)
    assert work(led)[0].bytes == 2 * x.numel() * 4


# ---- in-place, out=, allocation ----------------------------------------------------------------


def test_in_place_reads_and_writes_its_target():
    x, y = torch.randn(500), torch.randn(500)

    def f(x, y):
        x.add_(y)
        x.mul_(2.0)
        return x

    led = L.measure(f, x, y)
    add, mul = led.rows
    assert add.kind == mul.kind == "in-place"
    assert (add.bytes_read, add.bytes_written) == (4000, 2000)
    assert (mul.bytes_read, mul.bytes_written) == (2000, 2000)
    # one kernel: read x and y, write x
    assert led.fused_bytes() == 6000
    assert led.largest_intermediate() is None


def test_out_argument_is_only_written():
    x, out = torch.randn(300), torch.empty(300)
    led = L.measure(lambda x, out: torch.exp(x, out=out), x, out)
    (r,) = led.rows
    assert r.kind == "out=" and (r.bytes_read, r.bytes_written) == (1200, 1200)


def test_overwriting_ops_do_not_read_their_target():
    x, src = torch.randn(300), torch.randn(300)

    def f(x, src):
        x.fill_(1.0)
        x.zero_()
        x.copy_(src)
        x.bernoulli_(0.5)
        return x

    led = L.measure(f, x, src)
    assert [(r.bytes_read, r.bytes_written) for r in led.rows] == [(0, 1200), (0, 1200), (1200, 1200), (0, 1200)]


def test_allocation_moves_nothing_and_like_factories_read_nothing():
    x = torch.randn(100, 10)

    def f(x):
        return torch.empty_like(x), torch.zeros_like(x), x.new_ones(5), torch.empty(7)

    led = L.measure(f, x)
    assert [r.kind for r in led.rows] == ["alloc", "", "", "alloc"]
    assert [(r.bytes_read, r.bytes_written) for r in led.rows] == [(0, 0), (0, 4000), (0, 20), (0, 0)]


# ---- matmuls and reductions ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_bytes_and_flops(device):
    M, K, N = 48, 80, 24
    a = torch.randn(M, K, device=device, dtype=torch.float16)
    b = torch.randn(K, N, device=device, dtype=torch.float16)
    (r,) = L.measure(torch.mm, a, b).rows
    assert r.bytes_read == (M * K + K * N) * 2 and r.bytes_written == M * N * 2
    assert r.flops == 2 * M * N * K


def test_reductions_write_their_smaller_shape():
    x = torch.randn(64, 300)
    (s,) = L.measure(lambda x: x.sum(dim=1), x).rows
    assert (s.bytes_read, s.bytes_written) == (64 * 300 * 4, 64 * 4)
    (m,) = L.measure(lambda x: x.amax(), x).rows
    assert (m.bytes_read, m.bytes_written) == (64 * 300 * 4, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_counts_its_statistics(device):
    rows_, cols = 33, 200
    x = torch.randn(rows_, cols, device=device)
    w, b = torch.randn(cols, device=device), torch.randn(cols, device=device)
    led = L.measure(lambda x: F.layer_norm(x, (cols,), w, b), x)
    (r,) = work(led)
    assert r.name == "native_layer_norm"
    assert r.bytes_read == (rows_ * cols + 2 * cols) * 4
    assert r.bytes_written == (rows_ * cols + 2 * rows_) * 4  # output, mean and rstd


def test_largest_intermediate_skips_outputs_and_views():
    x = torch.randn(32, 64)

    def f(x):
        big = x.unsqueeze(0).expand(16, 32, 64)  # a view: no tensor of its own
        h = torch.cat([x, x], dim=1)             # (32, 128): the largest tensor made and dropped
        s = h.sum(dim=1)
        y = torch.outer(s, s)                    # (32, 32), but returned
        return y.view(-1), big

    led = L.measure(f, x)
    inter = led.largest_intermediate()
    assert inter.shape == (32, 128) and inter.nbytes == 32 * 128 * 4 and inter.op == "aten.cat.default"
    assert led.rows[inter.row].op == "aten.cat.default"
    # without knowing the outputs, everything made is a candidate
    led.outputs = None
    assert led.largest_intermediate().nbytes == 32 * 128 * 4
    with pytest.raises(ValueError, match="measure"):
        led.fused_bytes()


def test_fused_bytes_with_an_intermediate_that_is_also_returned():
    x = torch.randn(1000)

    def f(x):
        h = x * 3.0
        return h, torch.relu(h)

    led = L.measure(f, x)
    assert led.total == 4 * 4000
    assert led.fused_bytes() == 3 * 4000  # h must be written anyway: only its re-read is saved


# ---- dtypes and devices ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, size", [(torch.float64, 8), (torch.float32, 4), (torch.bfloat16, 2),
                                         (torch.float16, 2), (torch.int8, 1), (torch.int64, 8)])
def test_dtype_sizes(dtype, size):
    x = (torch.rand(123) * 100).to(dtype)
    (r,) = L.measure(lambda x: x + x, x).rows
    assert r.bytes_read == r.bytes_written == 123 * size


def test_casts_read_one_dtype_and_write_another():
    x = torch.randn(100, dtype=torch.bfloat16)
    (r,) = L.measure(lambda x: x.float(), x).rows
    assert (r.bytes_read, r.bytes_written) == (200, 400)
    (r,) = L.measure(lambda x: x > 0, x).rows
    assert (r.bytes_read, r.bytes_written) == (200, 100)  # bool is one byte


def test_cpu_and_meta_agree():
    def f(x, r, w, b):
        return F.silu(F.layer_norm(x + r, (x.shape[-1],), w, b)) * r

    def run(device):
        args = [torch.randn(5, 17, device=device), torch.randn(5, 17, device=device),
                torch.randn(17, device=device), torch.randn(17, device=device)]
        led = L.measure(f, *args)
        return [(r.op, r.bytes_read, r.bytes_written) for r in led.rows], led.fused_bytes()

    assert run("cpu") == run("meta")


def test_meta_tensors_count_bytes_too_big_to_allocate():
    logits = torch.empty(8192, 128256, device="meta", dtype=torch.bfloat16)
    target = torch.empty(8192, device="meta", dtype=torch.int64)
    led = L.measure(F.cross_entropy, logits, target)
    assert led.largest_intermediate().nbytes == 8192 * 128256 * 2
    assert led.fused_bytes() == 8192 * 128256 * 2 + 8192 * 8 + 2


def test_table_and_repr():
    x = torch.randn(1000)
    led = L.measure(lambda x: (x * 2).t(), x)
    text = led.table()
    assert "mul.Tensor" in text and "view" in text and "f32[1000]" in text and "total (1 kernel)" in text
    assert "4,000" in led.table(exact=True)
    assert "1 kernel," in repr(led) and str(led) == text


def test_fmt_bytes():
    assert L.fmt_bytes(999) == "999 B"
    assert L.fmt_bytes(16_777_216) == "16.8 MB"
    assert L.fmt_bytes(4.2e9) == "4.2 GB"
    assert L.fmt_bytes(268_435_456) == "268 MB"
