"""What a call lowers to, without a GPU: the one StableHLO op counter of the benchmarks and the
tests (docs/semantics.md §7's counting rule; tests/kernels/test_kernels.py checks the rule, the
program-size tests of tests/kernels/test_loop_free.py and tests/sizing/sweep/test_replay.py count with
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


# --- What XLA puts around the call: the loop body of a scan compiled with a CPU stand-in ---

#: The CPU custom call that stands in for the Triton call: registered on the host by every
#: jaxlib the project supports (0.10.2 to 0.12), a typed-FFI handler that reads no attribute.
#: The compile only instantiates it; nothing runs it.
STANDIN_TARGET = "dce_sink"

_TRITON_CALL = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(")
_TRITON_CONFIG = re.compile(r'backend_config = "", mhlo\.backend_config = \{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}, ')


def standin_module(text: str) -> str:
    """A CUDA-lowered module's text with every Triton custom call replaced by the CPU stand-in
    (:data:`STANDIN_TARGET`): same operands, results, layouts and ``output_operand_aliases``,
    the Triton program and its launch parameters dropped."""
    text, calls = _TRITON_CALL.subn(f"stablehlo.custom_call @{STANDIN_TARGET}(", text)
    text, configs = _TRITON_CONFIG.subn("api_version = 4 : i32, ", text)
    if configs != calls:
        raise ValueError(f"expected each Triton custom call's config, found {calls} calls and "
                         f"{configs} configs")
    return text


def compile_cpu(text: str) -> str:
    """The optimized HLO text of a StableHLO module compiled by XLA:CPU (JAX internals: the
    CPU client's ``compile_and_load`` on jax >= 0.7, its ``compile`` before)."""
    from jax._src import xla_bridge
    from jax._src.lib import xla_client

    targets = getattr(xla_client._xla, "custom_call_targets", None)
    if targets is not None and STANDIN_TARGET not in targets("Host"):
        raise RuntimeError(f"this jaxlib registers no {STANDIN_TARGET!r} custom call on the host "
                           f"(jax {jax.__version__}): pick another stand-in for the census")
    client = xla_bridge.get_backend("cpu")
    options = xla_client.CompileOptions()
    if hasattr(client, "compile_and_load"):
        executable = client.compile_and_load(text, client.devices()[:1], options)
    else:  # pragma: no cover (older jaxlib)
        executable = client.compile(text, options)
    return executable.hlo_modules()[0].to_string()


#: HLO instructions that move no data (no kernel on a GPU).
FREE_HLO = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z\-]*)\((.*?)\)(.*)$")


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO text -> {computation name: its instruction lines} (the entry under ``"ENTRY"``)."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) \(", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and line.strip():
            out[name].append(line)
    return out


def loop_body_census(hlo: str) -> dict:
    """The instructions of the one ``while`` body (a ``lax.scan``'s) in optimized HLO, as
    the GPU would launch them: ``copies`` (a ``copy``, or a fusion whose root is one), less the
    copy of the loop counter (a scan's own ``s32[]``, also in a trivial body's loop) counted
    apart as ``counter_copies``; ``fusions`` (the others); ``calls`` (custom calls);
    ``others`` (every other instruction that moves data), and ``copy_shapes``, the shapes the
    counted copies write."""
    comps = _computations(hlo)
    whiles = [line for lines in comps.values() for line in lines if " while(" in line]
    if len(whiles) != 1:
        raise ValueError(f"expected one while loop, found {len(whiles)}")
    body = re.search(r"body=%([\w.\-]+)", whiles[0]).group(1)
    counter = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}', whiles[0])
    counter = int(counter.group(1)) if counter else 0
    lines = comps[body]
    gte_index = {}
    for line in lines:
        m = re.match(r"^\s*%([\w.\-]+) = .*get-tuple-element\(%[\w.\-]+\), index=(\d+)", line)
        if m:
            gte_index[m.group(1)] = int(m.group(2))
    param = next((re.match(r"^\s*%([\w.\-]+) = ", line).group(1) for line in lines
                  if " parameter(0)" in line), None)
    census = {"copies": 0, "counter_copies": 0, "fusions": 0, "calls": 0, "others": 0,
              "copy_shapes": []}
    for line in lines:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, op, operands, rest = m.groups()
        if op in FREE_HLO:
            continue
        shape = line.split(" = ", 1)[1].split(" ", 1)[0]
        is_copy = op == "copy"
        if op == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", rest).group(1)
            root = next((x for x in comps.get(called, ()) if x.lstrip().startswith("ROOT")), "")
            is_copy = bool(re.search(r" copy\(", root))
        if is_copy:
            source = operands.split(",")[0].strip().lstrip("%")
            src_line = next((x for x in lines if re.match(rf"^\s*%{re.escape(source)} = ", x)),
                            "")
            if (op == "copy" and gte_index.get(source) == counter and param
                    and f"get-tuple-element(%{param})" in src_line):
                census["counter_copies"] += 1
            else:
                census["copies"] += 1
                census["copy_shapes"].append(shape)
        elif op == "fusion":
            census["fusions"] += 1
        elif op == "custom-call":
            census["calls"] += 1
        else:
            census["others"] += 1
    return census


def scan_census(fn, *args) -> dict:
    """:func:`loop_body_census` of ``fn`` (whose one loop is a ``lax.scan``) lowered for CUDA
    (:func:`lower_cuda`), its Triton calls replaced by the CPU stand-in and compiled by
    XLA:CPU."""
    return loop_body_census(compile_cpu(standin_module(lower_cuda(fn, *args).as_text())))
