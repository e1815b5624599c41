"""What every op shares: where it runs, input checks, launch settings, and how an op is registered.

Dispatch rule, the one every op follows (``route``): CUDA tensors run the Triton kernels; CPU tensors
run the plain PyTorch reference, unless ``TRITON_INTERPRET=1`` is set, in which case
the Triton kernels themselves run on the CPU through Triton's interpreter (how CI
checks them).

Registration, the one recipe every op follows (``triton_op``): an op's registered body is its
launcher, whose kernels all go through ``launch``. The op is a ``torch.library.triton_op``, so under
torch.compile AOTAutograd traces the body (its fake implementation too: no ``register_fake``) and
each ``launch`` becomes a ``triton_kernel_wrapper`` node that Inductor launches from its own
generated code: no onepass Python runs per call of a compiled model. A body must therefore trace
under fake tensors: torch ops, Python on shapes, dtypes and devices, and ``launch`` only (no
``.item()``, no ``data_ptr()``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime import driver

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Widest row a norm kernel keeps in registers in one block; longer rows loop over
# blocks of this size. 16384 fp32 values per program stay in registers with 16 warps
# (32 values a thread).
MAX_ROW_BLOCK = 16384


# Read once, as Triton reads it: ``@triton.jit`` picks the interpreter when the kernel is
# defined, so the switch must be set before Triton and onepass are imported.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    return _INTERPRETING


# Set by reference_mode(); ONEPASS_REFERENCE=1 does the same for the whole process.
force_reference = False


@contextlib.contextmanager
def reference_mode() -> Iterator[None]:
    """Inside this block every onepass op runs its PyTorch reference (like ONEPASS_REFERENCE=1)."""
    global force_reference
    previous, force_reference = force_reference, True
    try:
        yield
    finally:
        force_reference = previous


def use_triton(x: torch.Tensor) -> bool:
    """True where the Triton kernels run for a tensor on this device (never in reference mode)."""
    if force_reference or os.environ.get("ONEPASS_REFERENCE") == "1":
        return False
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


def use_triton_dot(x: torch.Tensor) -> bool:
    """``use_triton`` for the kernels built on ``tl.dot`` (attention, decode_linear), except
    bfloat16 in Triton's interpreter, whose ``tl.dot`` on bfloat16 tiles returns garbage
    (Triton 3.6: values of 1e10 for products of order 1): those calls take the reference."""
    return use_triton(x) and not (x.device.type == "cpu" and x.dtype == torch.bfloat16)


# ----------------------------------------------------------------------------- checks


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_dtype_option(name: str, dtype: torch.dtype | None) -> None:
    """An optional output dtype (None: the op's default): one the kernels write."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be None, torch.float32, float16 or bfloat16, got {dtype}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    device = None
    for v in tensors.values():
        if v is None:
            continue
        if device is None:
            device = v.device
        elif v.device != device:
            listing = ", ".join(f"{k} on {t.device}" for k, t in tensors.items() if t is not None)
            raise ValueError(f"all tensors must be on one device, got {listing}")


def check_tensor_lists(**groups) -> None:
    """Each argument a list (or other iterable) of tensors, not one tensor: iterating one would take its
    rows for separate tensors."""
    for name, group in groups.items():
        if isinstance(group, torch.Tensor):
            raise TypeError(f"{name} must be a list of tensors, e.g. [t], got one tensor")


def check_same_shape(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(t.shape)}")


def check_vector(name: str, t: torch.Tensor | None, length: int) -> None:
    """A per-feature parameter (norm weight, bias): 1-D of the hidden size."""
    if t is None:
        return
    check_float(name, t)
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be 1-D of length {length} (the last dim of the input), "
                         f"got shape {tuple(t.shape)}")


def check_linear(x_name: str, x: torch.Tensor, weight_name: str, weight: torch.Tensor, bias_name: str,
                 bias: torch.Tensor | None, out_name: str = "out_features") -> None:
    """A linear layer's weight [out, K] and optional bias [out], both in the dtype of its input x [*, K]."""
    check_float(weight_name, weight)
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{weight_name} must be [{out_name}, {k}] ({x_name}'s last dim), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{weight_name} must have {x_name}'s dtype {x.dtype}, got {weight.dtype}")
    if bias is not None:
        check_float(bias_name, bias)
        n = weight.shape[0]
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"{bias_name} must be 1-D of length {n} and dtype {x.dtype}, "
                             f"got {tuple(bias.shape)} {bias.dtype}")


def is_number(value) -> bool:
    """A finite int or float (not a bool), a symbolic one too: torch.compile traces a float as
    a SymFloat when it differed between compiles (a module attribute, an argument), which
    ``isinstance(value, float)`` and ``math.isfinite`` refuse (a graph break)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float, torch.SymInt, torch.SymFloat))
            and -math.inf < value < math.inf)


def is_int(value) -> bool:
    """An int and not a bool (a count or a size argument)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_scale(scale) -> None:
    """None (the default scale) or a finite number (attention's score scale)."""
    if scale is not None and not is_number(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def check_softcap(softcap) -> None:
    """None or a finite number > 0 (the logit soft-cap of attention and the losses)."""
    if softcap is not None and not (is_number(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")


def check_probability(name: str, p: float) -> None:
    # a float passes without the numbers.Real test, an abstract class's (slow) isinstance
    if type(p) is not float and (isinstance(p, bool) or not (isinstance(p, (numbers.Real, torch.SymInt, torch.SymFloat))
                                                          or (isinstance(p, torch.Tensor) and p.dim() == 0))):
        raise TypeError(f"{name} must be a number, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")


def autocast_inputs(x: torch.Tensor, params: list[torch.Tensor | None]
                    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """x and the parameters in autocast's dtype when autocast is on (as F.linear casts them)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, params
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), [p.to(dtype) if p is not None else None for p in params]


# ------------------------------------------------------------------------- layouts


def empty_output(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of ``like``'s shape, in ``dtype`` (default: ``like``'s), on its device: what
    ``torch.empty(like.shape, dtype=..., device=like.device)`` gives, at about half the host time (and of
    ``like``'s class where that is a tensor subclass with ``__torch_function__``, as torch's ``*_like`` ops
    return)."""
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride (the kernels' tiles need that, nothing more), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as [rows, last dim] with unit stride along the row; copies only if it must."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else x.reshape(1, 1)  # (-1 fails at 0 columns)
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(``x`` as a kernel reads it, its number of rows of the last dim, the stride between them), for launchers
    that pass only the pointer: ``x`` itself where its rows lie evenly with unit stride (2-D, or contiguous), with
    no [rows, last dim] view (each costs host time); else ``as_rows(x)``."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x, x.shape[0], x.stride(0)
    if x.dim() and x.is_contiguous():
        n = x.shape[-1]
        return x, (x.numel() // n if n else math.prod(x.shape[:-1])), n
    rows = as_rows(x)
    return rows, rows.shape[0], rows.stride(0)


def flat(x: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of ``x`` (copies only a non-contiguous input)."""
    return x.contiguous().view(-1)


# ---------------------------------------------------------------- launch settings


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), for host code: ``triton.cdiv`` is a constexpr function whose wrapper
    costs more host time a call than it saves."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host code (see ``cdiv``)."""
    return 1 << max(n - 1, 0).bit_length()


# every cached_plan's cache (clear_cached_plans)
_plan_caches: list = []


def cached_plan(fn):
    """``functools.lru_cache`` for a function of ints and bools that plans a launch (block, warps, grid):
    the lookup costs less host time than the arithmetic. Symbolic sizes (torch.compile's dynamic
    shapes) are unhashable: those calls compute the plan."""
    cached = functools.lru_cache(maxsize=4096)(fn)
    _plan_caches.append(cached)

    @functools.wraps(fn)
    def plan(*args, **kwargs):
        try:
            return cached(*args, **kwargs)
        except TypeError:  # an unhashable (symbolic) size
            return fn(*args, **kwargs)

    return plan


def clear_cached_plans() -> None:
    """Forget every cached launch plan: for benchmarks that replace a setting a plan reads."""
    for cache in _plan_caches:
        cache.cache_clear()


@functools.lru_cache(maxsize=None)
def _properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def _cuda_properties(device: torch.device):
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def num_programs_for(device: torch.device) -> int:
    """How many programs fill the device when each loops over many rows."""
    if device.type != "cuda":
        return 4  # the interpreter: few programs, big blocks, fewer Python steps
    return _cuda_properties(device).multi_processor_count


def device_setting(device: torch.device | None, by_name: dict, default):
    """``by_name``'s value for the first key in the GPU's name (e.g. "H100"), else ``default``
    (also off CUDA): for launch settings whose best value differs between GPUs of one
    architecture, each measured on the GPU it names."""
    if device is None or device.type != "cuda":
        return default
    name = _cuda_properties(device).name
    return next((value for part, value in by_name.items() if part in name), default)


def row_settings(n_cols: int, values_per_thread: int = 16) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for kernels that hold one row (or one row block) per program.

    Warps grow with the block so each thread holds ``values_per_thread`` values (when the
    block is large enough): enough 16-byte loads in flight per thread without spilling.
    """
    block = min(next_power_of_2(max(n_cols, 1)), MAX_ROW_BLOCK)
    num_warps = max(1, min(16, block // (32 * values_per_thread)))
    return block, num_warps


# ---------------------------------------------------- programmatic dependent launch

# ONEPASS_PDL=0 turns it off for the process (read once, at import).
_PDL_OFF = os.environ.get("ONEPASS_PDL") == "0"


def dependent_launch(t: torch.Tensor) -> bool:
    """Whether the kernels that read ``t`` launch as programmatic dependents (PDL, sm_90 and newer):
    such a kernel is let onto the GPU while the one before it in the stream still runs, and waits in
    ``wait_for_previous_kernel`` for that one's writes, so the gap between two kernels (a microsecond
    or two, most of a small kernel's time in a decode step) overlaps the earlier kernel's tail. Off
    in the interpreter, while anything traces the call (Inductor launches the kernel itself) and with
    ONEPASS_PDL=0. ``launch`` reads the kernel's ``PDL`` argument."""
    return (t.is_cuda and not _PDL_OFF and not interpreting() and not tracing(t)
            and _cuda_properties(t.device).major >= 9)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """A PDL kernel's first step, before it reads or writes global memory: wait until the kernel
    before it has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_next_kernel(PDL: tl.constexpr):
    """Let the kernel after this one launch once every program of this one has called it (its
    programs then wait in ``wait_for_previous_kernel``, holding only the SM room this grid leaves).
    Called first by a kernel of few programs; after its main loop by one that needs every SM: the
    next kernel's programs, let in early, would sit on the SMs that had room and leave others idle
    when a wide kernel follows."""
    if PDL:
        gdc_launch_dependents()


# ---------------------------------------------------------------------- lean launch

# (kernel, device, specialization, options) -> the compiled kernel Triton returned for it
_compiled_kernels: dict = {}


def _launch_hooks_set() -> bool:
    hook = knobs.runtime.launch_enter_hook
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``, with less host time on a GPU.

    Triton's own launch (3.6) spends host time on bookkeeping around the two steps that
    matter: the binder (which specializes the arguments: dtypes, 16-byte alignment,
    integers equal to 1 or divisible by 16) and the compiled kernel's launcher. This keeps,
    per specialization the binder reports, the compiled kernel Triton returned for it and
    calls its launcher directly, which saves host time a launch (measured by
    benchmarks/host_overhead.py; no committed table yet). The first call of each
    specialization, the interpreter, and runs with Triton launch hooks set (profilers such
    as proton) take Triton's own path.

    While anything traces the call (``tracing``: fake tensors, or the functional tensors
    AOTAutograd passes a ``triton_op``'s body), the launch goes through ``wrap_triton``: a
    ``triton_kernel_wrapper`` node in the traced graph, which Inductor launches itself. Under
    Triton's interpreter a traced launch does nothing: its kernels are Python functions that no
    graph can hold, which is why ``triton_op`` keeps the op opaque there.

    A kernel passed ``PDL=True`` (``dependent_launch``) launches as a programmatic dependent.
    """
    if meta.get("PDL"):
        meta["launch_pdl"] = True
    if tracing(args[0]):
        if not interpreting():
            wrap_triton(kernel)[grid](*args, **meta)
        return
    if interpreting() or _launch_hooks_set():
        kernel[grid](*args, **meta)
        return
    device = driver.active.get_current_device()
    bound, specialization, options = kernel.device_caches[device][4](*args, **meta)
    key = (kernel, device, tuple(specialization), tuple(options.items()), knobs.runtime.debug,
           knobs.compilation.instrumentation_mode)
    compiled = _compiled_kernels.get(key)
    if compiled is None:
        _compiled_kernels[key] = kernel[grid](*args, **meta)
        return
    grid = (*grid, 1, 1)
    compiled.run(grid[0], grid[1], grid[2], driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *bound.values())


# ------------------------------------------------------------------- eager fast path


def registered_outputs(outputs: tuple, like: torch.Tensor) -> tuple:
    """A launcher's outputs as a registered op returns them: each absent one (None) as an
    empty tensor of ``like``'s dtype, for a registered op returns tensors only. Launchers return
    None rather than allocating placeholders: each allocation costs host time, more inside an
    autograd step."""
    return tuple(like.new_empty(0) if o is None else o for o in outputs)


def eager_autograd(launch_fwd, setup_context, backward, returns: int | None = None):
    """The same launcher, setup_context and backward as a registered op, under a plain
    ``torch.autograd.Function``: eager calls skip torch.library's dispatch layers.
    ``returns``: how many leading outputs of the launcher the Function gives back (default
    all); the rest (statistics for the backward) reach only ``setup_context``. Each output
    costs host time in ``Function.apply``.

    This about halves an eager step's host time against the registered op; the forward takes
    ``ctx`` itself (the older Function style), cheaper than a separate ``setup_context``
    (benchmarks/host_overhead.py). Under torch.compile the registered op runs (see ``route``).
    """

    def forward(ctx, *inputs):
        output = launch_fwd(*inputs)
        setup_context(ctx, inputs, output)
        return output if returns is None else output[:returns]

    fn = type("EagerAutograd", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    })
    return fn.apply


def first_order_only(op: str) -> None:
    """Called by a backward before its work: refuse a backward that autograd records itself
    (``create_graph=True``: second derivatives, Hessian-vector products, gradient penalties).
    The kernels compute the gradients outside autograd, so they carry no graph back to the
    op's inputs and a second differentiation would silently leave this op's share out. It
    raises at the first backward (the gradient of a loss's logits is computed in the
    forward: no graph could even point at it), before any kernel runs or state changes."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"onepass {op}: no second derivative (a backward with create_graph=True) through its "
                           "Triton backward; the reference path has one (onepass.reference_mode() or "
                           "ONEPASS_REFERENCE=1)")


def tracing(t: torch.Tensor) -> bool:
    """Whether anything traces the call that ``t`` feeds (torch.compile, AOT autograd, fake tensors).

    Dynamo's and AOTAutograd's fake tensors are ``FakeTensor``s; AOTAutograd's functionalization
    passes a ``triton_op``'s body ``FunctionalTensor``s wrapping them, which ``is_fake`` sees through."""
    return torch.compiler.is_compiling() or (type(t) is not torch.Tensor and is_fake(t))


def triton_op(name: str, *, mutates_args=(), traced: bool = True):
    """Register a launcher as the op ``name``: ``torch.library.triton_op(name, mutates_args=...)``.

    The body (the launcher) is also the op's fake implementation, and under torch.compile
    AOTAutograd decomposes the op into the body's torch ops and kernel launches (``launch``),
    which Inductor launches itself. Under Triton's interpreter the same body is registered as a
    ``custom_op`` with itself as the fake implementation: the interpreter's kernels cannot enter
    a graph (``wrap_triton`` hands them back unwrapped), so the op stays opaque there and runs its
    launcher at each call of a compiled function, as every op did before.

    ``traced=False`` registers that opaque form on a GPU too, for ops whose traced form Inductor
    has not been seen to compute right (the ops say why). What a traced body must respect: an
    absent pointer argument's placeholder is an input the kernel reads, never an output (Inductor
    may treat every pointer argument as written and copy each back: a placeholder aliasing an
    output overwrites it), and one the analysis of the kernel takes as read only (else a scratch
    tensor of the op's own, as decode_linear's absent outputs): torch takes every
    pointer passed into a called jit function whose results address a store as written
    (tests/ops/test_traced_writes.py checks the ops' launches); float scalars may arrive as
    float64 (cast them before they meet fp32 accumulators).
    """
    if traced and not interpreting():
        return torch.library.triton_op(name, mutates_args=mutates_args)

    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.register_fake(fn)
        return op

    return register


def route(op, launch, *tensors: torch.Tensor | None, autograd=None):
    """Which of an op's three equivalent entry points serves this call.

    The registered op while anything traces (``tracing``): a ``triton_op`` (see ``triton_op``) that
    AOTAutograd traces into, so a compiled graph holds the op's kernel launches, which Inductor
    makes itself; ``autograd`` (from ``eager_autograd``) when a gradient will flow back through
    ``tensors``; else the bare launcher, whose host cost is the Triton launch alone
    (benchmarks/host_overhead.py compares the three).
    """
    first = tensors[0] if tensors[0] is not None else next(t for t in tensors if t is not None)
    if tracing(first):
        return op
    if autograd is not None and torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return autograd
    return launch
