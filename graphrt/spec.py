"""What a decode step takes and returns: ``Input`` (one input tensor) and ``StepSpec`` (the step).

A ``StepSpec`` is everything graphrt needs to capture a step per padded batch size: the
function, a description of each input (so graphrt can allocate static buffers, draw valid
example data for the analysis, warm-up and checks, and fill padded rows), the largest
batch, and the engine's hooks::

    spec = graphrt.StepSpec(
        fn=step,                                          # step(**inputs, n=...) -> tensor | tuple | dict
        inputs={"x": graphrt.Input((None, 2048), torch.bfloat16),               # [bs, 2048]
                "cu_seqlens": graphrt.Input((None,), torch.int32, high=64,
                                            offsets=True),                      # [bs + 1]
                "expert_bias": graphrt.Input((64,), torch.float32)},            # fixed [64]
        max_batch_size=256, live_count="n",
        outputs={"logits": "batch", "expert_load": "fixed"},   # optional: inferred otherwise
        state=lambda: [kv_cache, expert_load],                 # tensors the step writes
        example_inputs=engine.example_batch,                   # consistent examples (paged KV)
        before_replay=attn_backend.plan)                       # host planning at the padded size

Three kinds of input, by ``Input.rows``:

- ``batch``: shape ``(None, *trailing)``, ``bs`` rows; padded rows carry ``pad_value``.
- ``offsets``: shape ``(None,)`` with ``offsets=True``, ``bs + 1`` entries (``cu_seqlens``,
  ``query_start_loc``); padding continues the last live offset, so padded rows are empty.
- ``fixed``: a shape without ``None``; staged whole every step, never padded.

Graph safety: host-only (plain data; nothing here launches device work except ``random``/``pad``).
"""
from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from graphrt.errors import InputError, InputTypeError

OUTPUT_ROWS = ("batch", "fixed")


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _has_inf(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds infinities (the float8 ``e4m3fn``/``fnuz`` kinds do not: a
    cast of inf saturates or becomes NaN)."""
    return bool(torch.full((), math.inf).to(dtype).to(torch.float32).isinf())


def _fits(dtype: torch.dtype, value: float) -> bool:
    """Whether ``value`` is representable in ``dtype`` (integers: exactly; floats: in range)."""
    if dtype == torch.bool:
        return value in (0, 1)
    if _integral(dtype):
        info = torch.iinfo(dtype)
        if isinstance(value, float) and not value.is_integer():
            return False                          # (an int compares exactly: 10**400 too)
        return info.min <= value <= info.max
    if isinstance(value, int):                    # exact: 10**400 is no float to isnan()
        return abs(value) <= torch.finfo(dtype).max
    if math.isnan(value):
        return False
    if math.isinf(value):
        return _has_inf(dtype)
    return abs(value) <= torch.finfo(dtype).max


_DRAW_MAX = torch.iinfo(torch.int64).max  # torch.randint draws int64: its bound at most this


def distinct(low: int, high: int, k: int, generator: torch.Generator | None = None,
             exclude: Iterable[int] = ()) -> torch.Tensor:
    """``k`` distinct int64 values drawn uniformly from ``[low, high)`` minus ``exclude``, on
    the CPU. Its cost follows ``k``, not the range (``randperm`` of a 2**40 id range
    allocated the whole range): a permutation while the range is small, else draws that
    skip repeats. Raises ``InputError`` when the range holds fewer than ``k`` values."""
    exclude = {int(v) for v in exclude if low <= int(v) < high}
    span = high - low
    if span - len(exclude) < k:
        raise InputError(f"cannot draw {k} distinct values from [{low}, {high})"
                         + (f" without {len(exclude)} taken" if exclude else ""))
    if span <= 4 * (k + len(exclude)) + 64:
        perm = torch.randperm(span, generator=generator, device="cpu") + low
        keep = [v for v in perm.tolist() if v not in exclude][:k]
        return torch.tensor(keep, dtype=torch.int64, device="cpu")
    got: dict[int, None] = {}                     # insertion order: the draw's order
    while len(got) < k:
        for v in torch.randint(low, high, (2 * k + 16,), generator=generator, device="cpu").tolist():
            if v not in exclude and len(got) < k:
                got.setdefault(v)
    return torch.tensor(list(got), dtype=torch.int64, device="cpu")


def sentinel(inp: "Input") -> bool:
    """Whether ``inp`` pads with a sentinel: an integer input whose ``pad_value`` lies
    outside its valid values ``[low, high)`` (a scratch slot past the live ones, -1), which
    a step may test for to keep padded rows inert."""
    return _integral(inp.dtype) and inp.dtype != torch.bool and inp.high is not None \
        and not inp.low <= inp.pad_value < inp.high


@dataclass(frozen=True)
class Input:
    """One input of a step.

    Args:
        shape: ``(None, *trailing)`` for a batch-major input (``None`` stands for the batch:
            ``(None, hidden)``, ``(None,)``); a shape with no ``None`` for a fixed-shape input
            (device metadata, per-expert tables).
        dtype: the torch dtype of the tensor.
        low, high: the range of valid random values. Integer inputs draw uniformly from
            ``[low, high)`` and need ``high`` (at most int64's largest: draws are int64);
            floating inputs draw from ``N(0, 1)`` when ``high`` is None, else uniformly from
            ``[low, high)``; complex inputs draw ``N(0, 1)`` real parts (no ``high``); bool
            inputs draw fair coins.
            For ``offsets`` inputs the range is that of each row's increment.
        pad_value: the value padded rows carry (must be a valid value for the step: e.g. a
            scratch KV-cache slot, a context length of 0, token id 0). Not used by offsets
            (padding continues the last offset) or fixed inputs.
        unique: batch ``(None,)`` integer inputs only: rows draw distinct values (KV-cache
            slots: two live requests never share a slot).
        offsets: a ``(None,)`` integer input with ``bs + 1`` entries, non-decreasing from 0.
    """

    shape: tuple
    dtype: torch.dtype
    low: float = 0
    high: float | None = None
    pad_value: float = 0
    unique: bool = False
    offsets: bool = False

    def __post_init__(self):
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Iterable):
            raise InputTypeError(f"Input shape must be a tuple: (None, *trailing) for a "
                                 f"batch-major input or all ints for a fixed one, e.g. (None, 2048) "
                                 f"or (64,); got {self.shape!r} ({type(self.shape).__name__})")
        shape = tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        nones = [i for i, d in enumerate(shape) if d is None]
        if not shape or nones not in ([], [0]):
            raise InputError(f"Input shape must be (None, *trailing) for a batch-major input or "
                             f"all ints for a fixed one, e.g. (None, 2048) or (64,); got {shape}")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape[len(nones):]):
            raise InputError(f"Input dims must be non-negative ints; got {shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise InputError(f"Input dtype must be a torch.dtype; got {self.dtype!r}")
        integral = _integral(self.dtype)
        if integral and self.high is None:
            raise InputError(f"integer Input of dtype {self.dtype} needs high= (exclusive upper "
                             "bound of valid values) so graphrt can draw valid example data")
        for name in ("low", "high", "pad_value"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) and name != "pad_value"):
                raise InputError(f"Input {name} must be a number; got {v!r}")
        for name in ("low", "high"):
            v = getattr(self, name)
            if isinstance(v, float) and not math.isfinite(v):  # (an int is finite)
                raise InputError(f"Input {name} must be finite; got {v}")
            if integral and isinstance(v, float) and not v.is_integer():
                raise InputError(f"integer Input of dtype {self.dtype}: {name} must be a whole "
                                 f"number (values drawn from [low, high)); got {name}={v!r}")
        if self.high is not None and self.high <= self.low:
            raise InputError(f"Input needs low < high; got low={self.low}, high={self.high}")
        if integral and self.dtype != torch.bool:
            info = torch.iinfo(self.dtype)
            if self.low < info.min or self.high - 1 > info.max:
                raise InputError(f"Input range [{self.low}, {self.high}) does not fit {self.dtype} "
                                 f"([{info.min}, {info.max}]); narrow it or use a wider dtype")
            if self.high > _DRAW_MAX:
                raise InputError(f"Input range [{self.low}, {self.high}): example values are "
                                 f"drawn as int64, so high must be at most {_DRAW_MAX}; lower it")
        if self.dtype.is_complex and self.high is not None:
            raise InputError(f"complex Input of dtype {self.dtype} draws N(0, 1) real parts: "
                             f"leave high= unset (got low={self.low}, high={self.high})")
        if self.dtype.is_floating_point and self.high is not None and not (
                _fits(self.dtype, self.low) and _fits(self.dtype, self.high)):
            raise InputError(f"Input range [{self.low}, {self.high}) does not fit {self.dtype} "
                             f"(largest {torch.finfo(self.dtype).max}): its example data would be "
                             "inf; narrow it or use a wider dtype")
        if not _fits(self.dtype, self.pad_value):
            raise InputError(f"Input pad_value {self.pad_value!r} is not a valid {self.dtype} "
                             "value; pick one the dtype can hold (and the step accepts)")
        if self.unique and (not integral or shape != (None,)):
            raise InputError("Input(unique=True) needs an integer dtype and shape (None,)")
        if self.offsets and (not integral or shape != (None,) or self.unique):
            raise InputError("Input(offsets=True) needs an integer dtype and shape (None,) "
                             "(bs + 1 entries), and no unique=")
        if self.offsets and self.low < 0:
            raise InputError(f"Input(offsets=True): low and high bound each row's increment, and "
                             f"offsets never decrease; got low={self.low}: use low >= 0")

    @property
    def rows(self) -> str:
        """``batch``, ``offsets`` or ``fixed``."""
        if self.offsets:
            return "offsets"
        return "batch" if self.shape[0] is None else "fixed"

    @property
    def trailing(self) -> tuple[int, ...]:
        """The shape after the leading (batch) dimension (the whole shape when fixed)."""
        return self.shape if self.rows == "fixed" else self.shape[1:]

    def leading(self, bs: int) -> int:
        """The leading size for ``bs`` rows: ``bs``, ``bs + 1`` (offsets) or the fixed size."""
        return {"batch": bs, "offsets": bs + 1, "fixed": self.shape[0]}[self.rows]

    def shape_for(self, bs: int) -> tuple[int, ...]:
        """The concrete shape for ``bs`` rows."""
        return self.shape if self.rows == "fixed" else (self.leading(bs), *self.shape[1:])

    def random(self, bs: int, device: torch.device | str = "cpu",
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Valid random data for ``bs`` rows, of ``shape_for(bs)`` and ``dtype`` on ``device``.

        Drawn on the CPU (so a ``generator`` seeds it identically everywhere; also under
        ``torch.set_default_device``), then moved.
        Offsets are a prefix sum of ``bs`` increments drawn from ``[low, high)``, from 0.
        """
        shape = self.shape_for(bs)
        cpu = {"generator": generator, "device": "cpu"}
        if self.offsets:
            inc = torch.randint(int(self.low), int(self.high), (bs,), **cpu)
            t = torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), inc.cumsum(0)])
        elif self.dtype == torch.bool:
            t = torch.rand(shape, **cpu) < 0.5
        elif self.dtype.is_floating_point or self.dtype.is_complex:
            if self.high is None:
                t = torch.randn(shape, **cpu)
            else:                                 # in float64 where float32 would overflow
                wide = self.high - self.low > torch.finfo(torch.float32).max
                t = torch.rand(shape, dtype=torch.float64 if wide else None, **cpu)
                t = t * (self.high - self.low) + self.low
        elif self.unique:
            span = int(self.high) - int(self.low)
            if bs > span:
                raise InputError(f"Input(unique=True) cannot draw {bs} distinct values from "
                                 f"[{self.low}, {self.high})")
            t = distinct(int(self.low), int(self.high), bs, generator)
        else:
            t = torch.randint(int(self.low), int(self.high), shape, **cpu)
        return t.to(device=device, dtype=self.dtype)

    def pad(self, bs: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``shape_for(bs)`` filled with ``pad_value`` (offsets: zeros) on ``device``."""
        value = 0 if self.offsets else self.pad_value
        return torch.full(self.shape_for(bs), value, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class StepSpec:
    """A decode step as graphrt captures it.

    Args:
        fn: ``fn(**tensors)`` returning a tensor, a tuple or a dict of tensors, each either
            batch-major (``[bs, ...]``: graphrt hands back the live rows) or fixed-shape
            (the same shape at every size, e.g. per-expert counts ``[E]`` or a 0-d flag:
            handed back whole). It must not write into its inputs.
        inputs: ``{name: Input}``, the tensors ``fn`` takes by keyword; at least one is
            batch-major or offsets (it carries the batch).
        max_batch_size: the largest batch the step will be captured for.
        name: a label for reports (defaults to ``fn.__qualname__``).
        live_count: when set (e.g. ``"n"``), ``fn`` also receives that keyword: an int32
            device tensor of shape ``[1]`` holding the number of live rows; rows at index
            ``>= n`` are padding, so kernels can make them inert without a host sync.
        outputs: optional ``{key: "batch" | "fixed"}`` (dict keys or tuple indices; ``0`` for
            a single tensor). Undeclared outputs are inferred by comparing two batch sizes;
            a declaration the step does not follow is an ``InputError`` naming the shapes.
        out: when set (e.g. ``"out"``), ``fn`` also receives that keyword: ``None`` on eager
            calls and the first warm-ups (``fn`` allocates its outputs as usual), and, when a
            graph is captured (and in one warm-up before it), graphrt's static output
            buffers in the step's own layout (a dict, tuple or tensor; batch-major ones
            ``[padded_bs, ...]``). An output that ``fn`` writes into its buffer and returns
            (the same memory, shape, strides and dtype) needs no copy in the graph; any other
            is copied into the buffer at the graph's end, as without ``out``. ``fn`` must not
            read a buffer before writing it (it holds the last replay's values).
        state: the persistent device tensors the step writes (KV caches, in-graph counters),
            a sequence or a callable returning one. ``capture()`` and ``check_replay()`` put
            them back as they found them, and the check compares graph and eager from the
            same state.
        example_inputs: ``example_inputs(bs, device, generator) -> {name: tensor}``, valid and
            mutually consistent inputs for ``bs`` rows (block tables that point at allocated
            blocks, seq_lens that match); used instead of ``Input.random`` for the analysis,
            warm-up and checks.
        before_replay: ``before_replay(padded_bs, n)``, host-side planning at the padded size
            (FlashInfer ``plan()``-style metadata), called before every replay and before the
            warm-up and capture of each size. Host-only: it may launch copies into buffers the
            graph reads, never allocate them anew.
    """

    fn: Callable[..., Any]
    inputs: Mapping[str, Input]
    max_batch_size: int
    name: str | None = None
    live_count: str | None = None
    outputs: Mapping[Any, str] | None = None
    out: str | None = None
    state: Any = None
    example_inputs: Callable[..., Mapping[str, torch.Tensor]] | None = None
    before_replay: Callable[[int, int], None] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not callable(self.fn):
            raise InputError(f"StepSpec.fn must be callable; got {type(self.fn).__name__}")
        if not isinstance(self.inputs, Mapping) or not self.inputs:
            raise InputError("StepSpec.inputs must be a non-empty dict {name: graphrt.Input}")
        for key, inp in self.inputs.items():
            if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
                raise InputError(f"StepSpec.inputs key {key!r} must be a Python identifier: "
                                 "fn receives each input as a keyword argument")
            if not isinstance(inp, Input):
                raise InputError(f"StepSpec.inputs[{key!r}] must be a graphrt.Input; got "
                                 f"{type(inp).__name__}")
        if all(inp.rows == "fixed" for inp in self.inputs.values()):
            raise InputError("StepSpec.inputs has only fixed-shape inputs: at least one must be "
                             "batch-major (None, ...) or offsets=True, so the batch can be read")
        if not isinstance(self.max_batch_size, int) or isinstance(self.max_batch_size, bool) \
                or self.max_batch_size < 1:
            raise InputError(f"StepSpec.max_batch_size must be an int >= 1; got {self.max_batch_size!r}")
        for key, inp in self.inputs.items():
            if inp.offsets and (inp.high - 1) * self.max_batch_size > torch.iinfo(inp.dtype).max:
                raise InputError(f"StepSpec.inputs[{key!r}]: offsets of up to {self.max_batch_size}"
                                 f" rows with increments below {inp.high} can reach "
                                 f"{(inp.high - 1) * self.max_batch_size}, past {inp.dtype}'s "
                                 f"{torch.iinfo(inp.dtype).max}; lower high or use a wider dtype")
            if inp.unique and int(inp.high) - int(inp.low) < self.max_batch_size:
                raise InputError(f"StepSpec.inputs[{key!r}]: unique=True over [{inp.low}, "
                                 f"{inp.high}) has fewer distinct values than max_batch_size "
                                 f"{self.max_batch_size}; widen the range or lower the batch")
        if self.live_count is not None:
            if not isinstance(self.live_count, str) or not self.live_count.isidentifier():
                raise InputError(f"StepSpec.live_count must be a keyword name like 'n'; got {self.live_count!r}")
            if self.live_count in self.inputs:
                raise InputError(f"StepSpec.live_count {self.live_count!r} collides with an input name")
        if self.out is not None:
            if not isinstance(self.out, str) or not self.out.isidentifier() \
                    or keyword.iskeyword(self.out):
                raise InputError(f"StepSpec.out must be a keyword name like 'out'; got {self.out!r}")
            if self.out in self.inputs or self.out == self.live_count:
                raise InputError(f"StepSpec.out {self.out!r} collides with an input name or "
                                 "live_count: fn receives each as its own keyword")
        if self.outputs is not None:
            if not isinstance(self.outputs, Mapping):
                raise InputTypeError(f"StepSpec.outputs must be a dict {{key: 'batch' | 'fixed'}} "
                                     "(dict keys or tuple indices; 0 for a single tensor), e.g. "
                                     f"{{0: 'batch'}}; got {type(self.outputs).__name__} "
                                     f"{self.outputs!r}")
            bad = {k: v for k, v in dict(self.outputs).items() if v not in OUTPUT_ROWS}
            if bad:
                raise InputError(f"StepSpec.outputs values must be 'batch' or 'fixed'; got {bad}")
        for hook in ("example_inputs", "before_replay"):
            if getattr(self, hook) is not None and not callable(getattr(self, hook)):
                raise InputError(f"StepSpec.{hook} must be callable; got "
                                 f"{type(getattr(self, hook)).__name__}")
        if self.name is None:
            object.__setattr__(self, "name", getattr(self.fn, "__qualname__", repr(self.fn)))

    # -- example data ----------------------------------------------------------------------
    def random_inputs(self, bs: int, device: torch.device | str = "cpu",
                      generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Valid example inputs for ``bs`` rows, ``{name: shape_for(bs)}``: the
        ``example_inputs`` hook's when given (checked against the declarations), else
        ``Input.random`` per input."""
        if self.example_inputs is None:
            return {k: inp.random(bs, device, generator) for k, inp in self.inputs.items()}
        got = self.example_inputs(bs, torch.device(device), generator)
        if not isinstance(got, Mapping) or set(got) != set(self.inputs):
            keys = sorted(got) if isinstance(got, Mapping) else type(got).__name__
            raise InputError(f"{self.name}: example_inputs({bs}) must return a dict with the keys "
                             f"{sorted(self.inputs)}; got {keys}")
        for k, inp in self.inputs.items():
            t = got[k]
            if not isinstance(t, torch.Tensor) or t.dtype != inp.dtype \
                    or tuple(t.shape) != inp.shape_for(bs):
                what = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                        else type(t).__name__)
                raise InputError(f"{self.name}: example_inputs({bs})[{k!r}] must be "
                                 f"{inp.shape_for(bs)} {inp.dtype}; got {what}")
        return {k: got[k].to(device) for k in self.inputs}

    def state_tensors(self) -> list[torch.Tensor]:
        """The declared persistent state, as a list of tensors (empty when none)."""
        st = self.state() if callable(self.state) else self.state
        if st is None:
            return []
        st = list(st.values()) if isinstance(st, Mapping) else list(st) \
            if isinstance(st, Iterable) and not isinstance(st, torch.Tensor) else [st]
        for t in st:
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{self.name}: state must hold tensors; got {type(t).__name__}")
        return st

    # -- eager calls -----------------------------------------------------------------------
    def live_count_tensor(self, n: int, device: torch.device | str) -> torch.Tensor:
        """A fresh int32 ``[1]`` device tensor holding ``n`` (eager calls; graphs use a static one)."""
        return torch.full((1,), n, dtype=torch.int32, device=device)

    def batch_of(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """The live batch of ``inputs`` (from the first batch-major or offsets input)."""
        for k, inp in self.inputs.items():
            if inp.rows != "fixed":
                return inputs[k].shape[0] - (1 if inp.offsets else 0)
        raise AssertionError("StepSpec guarantees a batch input")

    def pad_inputs(self, inputs: Mapping[str, torch.Tensor], padded_bs: int) -> dict[str, torch.Tensor]:
        """``inputs`` of ``n`` rows extended to ``padded_bs`` as a graph's buffers hold them:
        ``pad_value`` rows, offsets continuing the last one, fixed inputs as they are."""
        n = self.batch_of(inputs)
        if padded_bs <= n:
            return dict(inputs)
        out = {}
        for k, t in inputs.items():
            inp = self.inputs[k]
            if inp.rows == "batch":
                t = torch.cat([t, inp.pad(padded_bs - n, t.device)])
            elif inp.rows == "offsets":
                t = torch.cat([t, t[-1:].expand(padded_bs - n)])
            out[k] = t
        return out

    def call_padded(self, inputs: Mapping[str, torch.Tensor], padded_bs: int,
                    rows: Mapping[Any, str] | None = None, plan: bool = False) -> Any:
        """Run ``fn`` eagerly as a graph of ``padded_bs`` rows would: the live rows of
        ``inputs`` followed by padding, the live count on the device; returns the outputs
        with batch-major ones trimmed to the live rows (``rows``: each output's kind; when
        None, ``outputs=``'s declarations, then a guess from this call: an output whose first
        dimension is ``padded_bs`` is batch-major. Pass ``rows`` (a runtime's
        ``manager.signature``, or ``{key: kind}``) for a fixed output that happens to be that
        long). ``plan``: call ``before_replay(padded_bs, n)`` first, as a replay of that size
        does (``run()``'s eager fallback and ``graphrt.testing``'s eager reference)."""
        n = self.batch_of(inputs)
        if plan and self.before_replay is not None:
            self.before_replay(padded_bs, n)
        first = next(iter(inputs.values()))
        out = self.call(self.pad_inputs(inputs, padded_bs), self.live_count_tensor(n, first.device))
        return self.live_outputs(out, n, max(padded_bs, n), rows)

    def live_outputs(self, out: Any, n: int, padded_bs: int,
                     rows: Mapping[Any, str] | None = None) -> Any:
        """``fn``'s outputs ``out`` of a ``padded_bs``-row call as a graph hands them back:
        batch-major ones trimmed to the ``n`` live rows. ``rows``: each output's kind (or a
        runtime's ``OutputSignature``); when None, ``outputs=``'s declarations, then a guess:
        an output whose first dimension is ``padded_bs`` is batch-major."""
        from graphrt.outputs import OutputLayout, OutputSignature
        if isinstance(rows, OutputSignature):
            rows = dict(zip(rows.layout.keys or (0,), rows.rows))
        layout, flat = OutputLayout.flatten(out, where=self.name)
        if rows is None:
            declared = dict(self.outputs or {})
            rows = {key: declared.get(key) or ("batch" if t.dim() and t.shape[0] == padded_bs
                                              else "fixed")
                    for key, t in zip(layout.keys or (0,), flat)}
        return layout.build([t[:n] if rows[key] == "batch" else t
                             for key, t in zip(layout.keys or (0,), flat)])

    def call(self, inputs: Mapping[str, torch.Tensor], n: torch.Tensor | None = None,
             out: Any = None) -> Any:
        """Run ``fn`` eagerly on ``inputs`` (passing the live count when the spec wants it,
        and ``out``, the output buffers or ``None``, when it takes ``out``)."""
        kwargs = dict(inputs)
        if self.live_count is not None:
            if n is None:
                device = next(iter(inputs.values())).device
                n = self.live_count_tensor(self.batch_of(inputs), device)
            kwargs[self.live_count] = n
        if self.out is not None:
            kwargs[self.out] = out
        elif out is not None:
            raise InputError(f"{self.name}: output buffers given but StepSpec.out is not set")
        return self.fn(**kwargs)
