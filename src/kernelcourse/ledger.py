"""The byte ledger: how many bytes each PyTorch operation reads and writes (introduced in chapter 03).

Run any PyTorch code under a ``Ledger`` and get one row per operation that reached PyTorch's
dispatcher (an aten op: in eager mode, roughly one kernel launch), with the bytes it read and wrote,
computed from the real tensors it was given and returned::

    with kc.ledger.Ledger() as led:
        y = torch.nn.functional.gelu(x * 0.5)
    print(led.table())            # one row per op, and the totals
    led.total                     # bytes read + written, an int

    led = kc.ledger.measure(f, x)  # the same, and it knows what f returned:
    led.fused_bytes()              # the bytes if all of f ran as one kernel
    led.largest_intermediate()     # the biggest tensor f made and did not return

It is built on ``TorchDispatchMode``: PyTorch hands the mode every aten op with its arguments, so
no list of ops is written down here. It works the same on CPU, CUDA and ``meta`` tensors (meta
tensors have shapes but no memory: the ledger can count the bytes of a model too big to run).

The rules (compulsory traffic: the least a kernel doing the op must move to and from memory):

- An op reads each distinct input tensor once and writes each output once. A kernel may move more
  (tiles re-read by a matmul, spills), never less, unless the data are still in cache.
- The bytes of a tensor are its footprint: the elements its view reaches, each once. A slice
  counts only the elements in the slice; a dimension with stride 0 (a bias broadcast over rows by
  ``expand``) counts once, because the repeats are served from cache; overlapping windows count
  no more than the span of storage between the first and last element. Memory moves whole 32-byte
  sectors, so a view with a large stride moves more than its footprint: the ledger counts elements.
- A view or alias (``view``, ``t``, ``expand``, ``as_strided``, ``detach``, ``_unsafe_view`` ...)
  moves nothing: its row shows 0 bytes and the kind ``view``. Views are found from the op's schema
  (its output aliases an input) or, at run time, from an output that shares its input's storage.
- An in-place op (``add_``) reads and writes its target; an ``out=`` argument is only written.
  Ops that overwrite their target without reading it are few and named here: ``fill_``, ``zero_``,
  ``copy_`` (which reads its source), and in-place random fills (tagged ``nondeterministic_seeded``).
- Allocation (``empty``, ``empty_like``, ...) moves nothing and is marked ``alloc``. Factories named
  ``*_like`` or ``new_*`` read only their argument's shape, not its bytes.
- Gathers (``nll_loss``, ``index_select``, ``embedding``) are charged their whole input: the ledger
  sees tensors, not which of their elements a kernel picks, so for them it is an upper bound.
- A row is one aten op. A few ops run as several kernels inside (``logsumexp``, for one); the
  ledger sees only the op, and charges it what it would move as a single kernel.

FLOPs in a row are nominal: exact for matmul-like ops (from ``torch.utils.flop_counter``), and one
per element of the largest tensor for everything else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Ledger", "Row", "TensorInfo", "Intermediate", "measure", "footprint", "chain_bytes", "fmt_bytes"]

# Allocation without initialisation: no kernel runs, no byte moves.
ALLOCATING = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                        "new_empty_strided"})
# In-place ops that write their target without reading what was there.
OVERWRITING = frozenset({"fill_", "zero_", "copy_"})

_SHORT_DTYPES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
                 torch.uint8: "u8", torch.bool: "b8"}


def footprint(t: torch.Tensor) -> int:
    """Bytes of storage the view ``t`` reaches, each element once (see the module's rules)."""
    if t.numel() == 0:
        return 0
    try:
        shape, stride = t.shape, t.stride()
    except RuntimeError:  # sparse or nested layouts have no strides: count their elements
        return t.numel() * t.element_size()
    reached = math.prod(n for n, s in zip(shape, stride) if s != 0)
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride))
    return min(reached, span) * t.element_size()


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units, as bandwidths are quoted: ``fmt_bytes(16_777_216)`` is '16.8 MB'."""
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
    raise AssertionError("unreachable")


def chain_bytes(n_elements: int, k: int, itemsize: int, fused: bool) -> int:
    """Bytes moved by a chain of ``k`` same-shape elementwise ops, each with one input, on ``n_elements``.

    Unfused, every op is its own kernel: it reads its input and writes its output, ``2 k N`` elements.
    Fused into one kernel, the input is read once, the intermediates stay in registers and only the
    result is written: ``2 N`` elements. The ratio is ``k``.
    """
    if k < 1:
        raise ValueError("a chain has at least one op")
    return (2 if fused else 2 * k) * n_elements * itemsize


@dataclass(frozen=True)
class TensorInfo:
    """What the ledger keeps of a tensor: never the tensor itself, so no memory is held."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    nbytes: int  # the footprint

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorInfo":
        try:
            stride = tuple(t.stride())
        except RuntimeError:
            stride = ()
        return cls(tuple(t.shape), t.dtype, stride, footprint(t))

    @property
    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.shape):
            expected.append(step)
            step *= n
        return all(s == e for n, s, e in zip(self.shape, self.stride, reversed(expected)) if n != 1)

    def __str__(self) -> str:
        dt = _SHORT_DTYPES.get(self.dtype, str(self.dtype).removeprefix("torch."))
        text = f"{dt}[{', '.join(map(str, self.shape))}]"
        return text if self.contiguous or not self.stride else text + " strided"


@dataclass(frozen=True)
class Row:
    """One op: what it was given and returned, and the bytes it read and wrote."""
    op: str                         # e.g. "aten.mul.Tensor"
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    bytes_read: int
    bytes_written: int
    kind: str                       # "", "view", "alloc", "in-place" or "out="
    flops: int                      # nominal (see the module's docstring)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def name(self) -> str:
        """The op without the namespace and the ``.default`` overload: 'mul.Tensor', 'gelu'."""
        return self.op.removeprefix("aten.").removesuffix(".default")


@dataclass(frozen=True)
class Intermediate:
    """A tensor an op made, found by ``Ledger.largest_intermediate``."""
    row: int          # index into ``Ledger.rows`` of the op that made it
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _tensors(obj) -> list[torch.Tensor]:
    return [a for a in tree_flatten(obj)[0] if isinstance(a, torch.Tensor)]


def _view_key(t: torch.Tensor, storage: int) -> tuple:
    """Identifies a view: the same storage, offset, shape, strides and dtype is the same data."""
    try:
        return storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype
    except RuntimeError:
        return storage, id(t)


def _kernels(n: int) -> str:
    return f"{n} kernel{'' if n == 1 else 's'}"


def _nominal_flops(func, args, kwargs, out, tensors) -> int:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula written for another signature: fall back to the nominal count
            pass
    return max((t.numel() for t in tensors), default=0)


class Ledger(TorchDispatchMode):
    """Records the bytes every aten op reads and writes while the ``with`` block runs.

    ``rows`` holds one ``Row`` per op; ``total_read``, ``total_written`` and ``total`` sum them;
    ``table()`` prints them. ``outputs`` is what the measured code returned (``measure`` sets it;
    after a ``with`` block, set it yourself): ``fused_bytes`` and ``largest_intermediate`` use it.
    """

    def __init__(self):
        super().__init__()
        self.rows: list[Row] = []
        self.outputs = None
        self.result = None
        # Storages are identified by their StorageImpl, which a weak reference keeps from being
        # recycled while the ledger lives; the data itself is freed as usual.
        self._weak: dict[int, StorageWeakRef] = {}
        self._made: set[int] = set()                  # storages some recorded op created
        self._fresh: list[tuple[int, TensorInfo, int]] = []  # (row, info, storage) of each new tensor
        self._external_reads: dict[tuple, int] = {}   # views of storages made before the ledger
        self._external_writes: dict[tuple, int] = {}

    # ---- recording -------------------------------------------------------------------------------

    def _storage(self, t: torch.Tensor) -> int:
        try:
            ref = StorageWeakRef(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse): its own id
            return id(t)
        self._weak.setdefault(ref.cdata, ref)
        return ref.cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        mutated, out_args = [], []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                (out_args if arg.is_out else mutated).extend(_tensors(value))
        out_ids = {id(t) for t in out_args}
        inputs = [t for t in _tensors((args, kwargs)) if id(t) not in out_ids]
        # Described before the op runs: an in-place op may change what it is given.
        in_infos = [TensorInfo.of(t) for t in inputs]
        in_storages = [self._storage(t) for t in inputs]
        in_keys = [_view_key(t, s) for t, s in zip(inputs, in_storages)]

        out = func(*args, **kwargs)

        outs = _tensors(out)
        packet = func.overloadpacket.__name__
        sources = set(in_storages)
        aliases = [self._storage(t) in sources for t in outs]
        flops = 0
        if func.is_view or torch.Tag.inplace_view in func.tags or (
                not mutated and not out_args and outs and all(aliases)):
            kind, read, written = "view", 0, 0
        elif packet in ALLOCATING:
            kind, read, written = "alloc", 0, 0
            self._remember_fresh([t for t, alias in zip(outs, aliases) if not alias])
        else:
            if packet.endswith("_like") or packet.startswith("new_"):
                unread = {id(t) for t in inputs}
            elif packet in OVERWRITING or (torch.Tag.nondeterministic_seeded in func.tags and mutated):
                unread = {id(t) for t in mutated}
            else:
                unread = set()
            read, seen = 0, set()
            for t, info, storage, key in zip(inputs, in_infos, in_storages, in_keys):
                if id(t) in unread or key in seen:
                    continue
                seen.add(key)
                read += info.nbytes
                if storage not in self._made:
                    self._external_reads.setdefault(key, info.nbytes)
            targets = mutated + out_args
            target_storages = set()
            written, seen = 0, set()
            for t in targets:
                storage = self._storage(t)
                target_storages.add(storage)
                key = _view_key(t, storage)
                if key in seen:
                    continue
                seen.add(key)
                written += footprint(t)
                if storage not in self._made:
                    self._external_writes.setdefault(key, footprint(t))
            # An in-place op returns its target, an out= op its out argument: written once, above.
            fresh = [t for t, alias in zip(outs, aliases)
                     if not alias and self._storage(t) not in target_storages]
            written += sum(footprint(t) for t in fresh)
            self._remember_fresh(fresh)
            kind = "in-place" if mutated else "out=" if out_args else ""
            flops = _nominal_flops(func, args, kwargs, out, inputs + outs)
        self.rows.append(Row(str(func), tuple(in_infos), tuple(TensorInfo.of(t) for t in outs),
                             read, written, kind, flops))
        return out

    def _remember_fresh(self, tensors) -> None:
        for t in tensors:
            storage = self._storage(t)
            self._made.add(storage)
            self._fresh.append((len(self.rows), TensorInfo.of(t), storage))

    # ---- totals ----------------------------------------------------------------------------------

    @property
    def total_read(self) -> int:
        return sum(r.bytes_read for r in self.rows)

    @property
    def total_written(self) -> int:
        return sum(r.bytes_written for r in self.rows)

    @property
    def total(self) -> int:
        return self.total_read + self.total_written

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def kernels(self) -> int:
        """Rows that do work (neither views nor bare allocations): in eager mode, kernel launches."""
        return sum(1 for r in self.rows if r.kind not in ("view", "alloc"))

    def _outputs(self, outputs) -> list[torch.Tensor]:
        outputs = self.outputs if outputs is None else outputs
        if outputs is None:
            raise ValueError("the ledger does not know what the code returned: use "
                             "kc.ledger.measure(fn, *args), or set led.outputs = (what the block returned)")
        return _tensors(outputs)

    def fused_bytes(self, outputs=None) -> int:
        """Bytes the code would move as one kernel: its inputs read once, its outputs written once.

        Inputs are the tensors it read that existed before it ran; outputs are what it returned
        (``outputs``, else ``self.outputs``) and any tensor from before that it changed in place.
        Every intermediate stays on chip: this is the floor that fusing everything could reach.
        """
        written = {}
        for t in self._outputs(outputs):
            storage = self._storage(t)
            if storage in self._made:  # returning an input, or a view of one, writes nothing
                written.setdefault(_view_key(t, storage), footprint(t))
        return sum(self._external_reads.values()) + sum(self._external_writes.values()) + sum(written.values())

    def largest_intermediate(self, outputs=None) -> Intermediate | None:
        """The biggest tensor an op made that is not (a view of) what the code returned.

        Views make no tensor of their own and are never candidates. With no ``outputs`` given or
        known, every tensor made is a candidate. Ties go to the first made.
        """
        known = outputs is not None or self.outputs is not None
        returned = {self._storage(t) for t in self._outputs(outputs)} if known else set()
        best = None
        for row, info, storage in self._fresh:
            if storage not in returned and (best is None or info.nbytes > best.nbytes):
                best = Intermediate(row, self.rows[row].op, info.shape, info.dtype, info.nbytes)
        return best

    # ---- printing --------------------------------------------------------------------------------

    def table(self, exact: bool = False) -> str:
        """The rows as a fixed-width table with the totals; ``exact`` prints bytes as integers."""
        show = (lambda n: f"{n:,}") if exact else fmt_bytes
        head = ("#", "op", "inputs", "outputs", "read", "written", "")
        body = []
        for i, r in enumerate(self.rows):
            body.append((str(i), r.name, ", ".join(map(str, r.inputs)) or "-", ", ".join(map(str, r.outputs)) or "-",
                         show(r.bytes_read), show(r.bytes_written), r.kind))
        foot = ("", f"total ({_kernels(self.kernels)})", "", "",
                show(self.total_read), show(self.total_written), f"= {show(self.total)}")
        cells = [head, *body, foot]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        left = {1, 2, 3, 6}

        def line(c):
            return "  ".join(c[i].ljust(w) if i in left else c[i].rjust(w) for i, w in enumerate(widths)).rstrip()
        rule = "-" * len(line(head))
        return "\n".join([line(head), rule, *map(line, body), rule, line(foot)])

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (f"<Ledger: {len(self.rows)} ops, {_kernels(self.kernels)}, read {fmt_bytes(self.total_read)}, "
                f"wrote {fmt_bytes(self.total_written)}>")


def measure(fn, *args, **kwargs) -> Ledger:
    """Run ``fn(*args, **kwargs)`` under a ``Ledger``; the ledger keeps what it returned in ``result``."""
    with Ledger() as led:
        result = fn(*args, **kwargs)
    led.result = led.outputs = result
    return led
