"""What a call lowers to, without a GPU: the one StableHLO op counter of the benchmarks and the
tests (docs/semantics.md §7's counting rule; tests/kernels/test_kernels.py checks the rule, the
program-size tests of tests/kernels/test_loop_free.py and tests/sizing/test_replay.py count with
it) and :func:`abstract_gpu`, the abstract H200 that lets a CPU host lower the fused kernel for
CUDA.

Since jax 0.11 lowering a Pallas Triton kernel for ``"cuda"`` needs a GPU device or an abstract
one; the CUDA-lowering tests, benchmarks/kernel_compile.py, benchmarks/step_ops.py and
benchmarks/gpu_check.py's dry run all lower through :func:`lower_cuda`.
"""

from __future__ import annotations

import contextlib
import re

import jax

#: StableHLO ops that cost nothing (or, ``custom_call``, are counted apart as Pallas calls).
UNCOUNTED = {"constant", "reshape", "bitcast_convert", "return", "custom_call", "tuple",
             "get_tuple_element", "optimization_barrier"}
PALLAS_CALL = "custom_call @__gpu$xla.gpu.triton"

#: The GPU the offline checks lower for (the lent machine's; SM count of an H200).
ABSTRACT_GPU_KIND, ABSTRACT_GPU_CORES = "NVIDIA H200", 132


def count_ops(text: str) -> tuple[int, int]:
    """``(Pallas calls, other non-free StableHLO ops)`` of a lowered module's text, by the
    counting rule of docs/semantics.md §7: a private function's body counts once (it is printed
    once), a scan's while body once plus its loop bookkeeping. An attribute such as
    ``#stablehlo.output_operand_alias<...>`` names no operation."""
    ops = [op for op in re.findall(r"(?<![#\w])stablehlo\.([a-z_0-9]+)", text)
           if op not in UNCOUNTED]
    return text.count(PALLAS_CALL), len(ops)


def abstract_gpu():
    """A context in which ``lower(lowering_platforms=("cuda",))`` works on a host without a GPU:
    nothing on a GPU host, else an abstract one-device mesh of an H200 (jax >= 0.11 refuses a
    Triton lowering with "No supported GPU devices found" otherwise; older JAX accepts both).
    Make the arguments outside it: it changes the mesh new values are placed on."""
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(abstract_gpu_mesh(1, "x"))


def abstract_gpu_mesh(num_devices: int, axis: str):
    """An abstract mesh of ``num_devices`` H200s on one axis, for ``jax.shard_map`` lowered for
    CUDA on any host (in :func:`jax.sharding.use_abstract_mesh`)."""
    from jax.sharding import AbstractMesh
    try:
        from jax.sharding import AbstractDevice
    except ImportError:  # jax 0.10 keeps it private
        from jax._src.mesh import AbstractDevice
    device = AbstractDevice(device_kind=ABSTRACT_GPU_KIND, num_cores=ABSTRACT_GPU_CORES,
                            platform="gpu")
    # Auto, not the default Explicit: an explicit axis would type every value made inside (a
    # scan's carry) as sharded over it, and mixing them with unsharded ones fails to lower.
    return AbstractMesh((num_devices,), (axis,), axis_types=(jax.sharding.AxisType.Auto,),
                        abstract_device=device)


def lower_cuda(fn, *args):
    """``jax.jit(fn)`` traced on ``args`` and lowered for CUDA (a fresh jit: nothing is served
    from a cache), under :func:`abstract_gpu`."""
    with abstract_gpu():  # the trace too: the kernel's lowering reads the mesh it was traced in
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
