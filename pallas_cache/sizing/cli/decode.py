"""``pallas-cache bench-decode``: an offloaded decode at a model's expert geometry, measured
beside the replay's model (:func:`pallas_cache.sizing.decode.bench_decode`); its arguments are
:mod:`~pallas_cache.sizing.cli.decode_args`'. Every refusal is one :class:`UsageError` raised
before the bank is made."""

from __future__ import annotations

import dataclasses
import json
import sys

from pallas_cache.sizing.cli.bench import available_memory
from pallas_cache.sizing.cli.decode_args import (DEFAULT_MODEL, DEFAULT_TOKENS, HOST_SHARE,
                                                  SMALL)
from pallas_cache.sizing.cli.parser import DEFAULT_PRESET, UsageError
from pallas_cache.sizing.models import MoEModel, resolve_model
from pallas_cache.sizing.units import format_bandwidth, format_bytes, parse_bytes

# Nothing above imports JAX or NumPy: a refused flag answers at once. The functions that need
# them (the expert formats' check, the routes, the decode) import them where the work starts.

__all__ = ["DecodeRequest", "Plan", "build_decode_request", "format_run", "plan_and_run",
           "plan_run", "run_bench_decode"]


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """What ``pallas-cache bench-decode`` was asked, checked (``None``: the default, decided
    by :func:`plan_run` once the device and the memory are known).

    Attributes:
      model, dtype: the expert geometry's model and its format (``--model``; ``--small``:
        float32).
      small: ``--small``'s geometry, layers and tokens where not given.
      d_model, d_expert, layers, tokens: the geometry's overrides and the decode's length.
      host_memory: the bank's host budget in bytes.
      cache_sizes: ``--cache-size`` texts (slots or bytes; ``None``: ``L*k`` and ``1.5*L*k``).
      trace, synthetic, seed: the routes (a file, or a preset) and the seed.
      policies, evictions: the configurations asked (``None``: the default trio).
      floor, no_cache: the every-expert-resident and the no-cache rows.
      bank_memory: ``auto`` or ``pinned_host``.
      repeats, rounds, time_limit: the timing's medians and limit.
      format, quiet: ``table`` or ``json``; no progress.
    """

    model: MoEModel
    dtype: str
    small: bool = False
    d_model: int | None = None
    d_expert: int | None = None
    layers: int | None = None
    host_memory: int | None = None
    cache_sizes: tuple[str, ...] | None = None
    trace: str | None = None
    synthetic: str | None = None
    tokens: int | None = None
    seed: int = 0
    policies: tuple[str, ...] | None = None
    evictions: tuple[str, ...] | None = None
    floor: bool = True
    no_cache: bool = True
    bank_memory: str = "auto"
    repeats: int = 3
    rounds: int = 5
    time_limit: float = 120.0
    format: str = "table"
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the command will run, checked: geometry, routes, sizes, rows."""

    geometry: object
    trace: object
    cache_sizes: tuple
    configurations: tuple
    floor: bool
    lines: tuple


def _fail(message: str):
    raise UsageError(f"pallas-cache: bench-decode: {message}")


def build_decode_request(args) -> DecodeRequest:
    """The :class:`DecodeRequest` of the ``bench-decode`` subcommand's namespace, after the
    checks the flags alone decide: counts, the time limit, the model and its format.

    Raises:
      UsageError: the first refusal, as the one line the CLI prints.
    """
    for flag in ("layers", "tokens", "d_model", "d_expert", "repeats", "rounds"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not args.time_limit > 0:
        _fail(f"--time-limit must be positive, got {args.time_limit}")
    text = args.model or (f"{DEFAULT_MODEL}:{SMALL['dtype']}" if args.small else DEFAULT_MODEL)
    try:
        model, dtype = resolve_model(text)
    except ValueError as error:
        _fail(str(error).replace(" (or give --expert-bytes)", ""))
    from pallas_cache.sizing.decode import check_expert_dtype  # imports JAX

    try:
        check_expert_dtype(dtype)
    except ValueError as error:
        _fail(f"--model {text}: {error}")
    optional = (None if value is None else tuple(value) for value in
                (args.cache_size, args.policy, args.eviction))
    cache_sizes, policies, evictions = optional
    return DecodeRequest(model, dtype, args.small, args.d_model, args.d_expert, args.layers,
                         args.host_memory, cache_sizes, args.trace, args.synthetic, args.tokens,
                         args.seed, policies, evictions, args.floor, args.no_cache,
                         args.bank_memory, args.repeats, args.rounds, args.time_limit,
                         args.format, args.quiet)


def plan_run(request: DecodeRequest, platform: str, device_memory: int | None) -> Plan:
    """Check everything and decide the layers, routes and rows before any bank is made."""
    model, dtype = request.model, request.dtype
    if request.bank_memory == "pinned_host" and platform != "gpu":
        _fail(f"--bank-memory pinned_host needs a GPU; this backend is {platform}")
    from pallas_cache.sizing.decode import Geometry  # imports JAX

    small = SMALL if request.small else {}
    d_model = request.d_model or small.get("d_model", model.d_model)
    d_expert = request.d_expert or small.get("d_expert", model.d_expert)
    if dtype == "int4" and d_model % 2:
        _fail(f"int4 packs two weights per byte: d_model must be even, got {d_model}")
    probe = Geometry(1, model.routed_experts, model.top_k, d_model, d_expert, dtype)
    layer_bytes = model.routed_experts * probe.expert_bytes
    # On a CPU the pools share the host's memory: the floor's L*E slots beside the bank; and one
    # leaf is made before it moves (a third of the bank); on a GPU both are device memory.
    per_layer = layer_bytes * (2 + 1 / 3) if platform == "cpu" else layer_bytes
    available = available_memory()
    if request.host_memory:
        budget = request.host_memory
    elif available:
        budget = int(HOST_SHARE * available)
    else:
        from pallas_cache.sizing.traces.memory import default_memory_limit
        budget = default_memory_limit()
    fits = int(budget // per_layer)
    where = (f"--host-memory {format_bytes(budget)}" if request.host_memory else
             f"{HOST_SHARE:g} of the available memory, {format_bytes(budget)}")
    if fits < 1:
        _fail(f"{where} fits no layer: one layer of {model.routed_experts} experts of "
              f"{format_bytes(probe.expert_bytes)} needs {format_bytes(int(per_layer))}"
              f"{' (bank and resident pool, on a CPU)' if platform == 'cpu' else ''}")
    asked = request.layers or small.get("layers")
    if asked is not None and asked > fits:
        _fail(f"--layers {asked} needs {format_bytes(int(asked * per_layer))}; {where} fits "
              f"{fits}")
    if asked is not None and asked > model.moe_layers:
        _fail(f"--layers {asked} is more than {model.name}'s {model.moe_layers} MoE layers")
    tokens = request.tokens or small.get("tokens", DEFAULT_TOKENS)
    trace, layers = _routes(request, model, asked, min(fits, model.moe_layers), tokens)
    geometry = Geometry(layers, model.routed_experts, trace.top_k, d_model, d_expert, dtype)
    sizes = _cache_sizes(request.cache_sizes, geometry)
    configurations = _configurations(request.policies, request.evictions)
    floor = request.floor
    lines = [f"{model.name} {dtype} at d_model {d_model} x d_expert {d_expert} (W = "
             f"{format_bytes(geometry.expert_bytes)}): L={layers} of {model.moe_layers} MoE "
             f"layers ({where} fits {fits}), E={geometry.num_experts}, top-{geometry.top_k}; "
             f"bank {format_bytes(layers * layer_bytes)}"]
    floor_bytes = geometry.resident_slots * geometry.expert_bytes
    if floor and device_memory is not None and floor_bytes > device_memory:
        floor = False
        lines.append(f"the floor row is left out: its {geometry.resident_slots} slots take "
                     f"{format_bytes(floor_bytes)}, past the device's "
                     f"{format_bytes(device_memory)} free")
    if not (floor or request.no_cache or sizes):
        _fail("no rows: give --cache-size, or drop --no-floor / --no-cache-row")
    return Plan(geometry, trace, sizes, configurations, floor, tuple(lines))


def _routes(request, model, asked: int | None, most: int, tokens: int):
    """``(trace, layers)``: the dense ``[tokens, layers, k]`` routes."""
    from pallas_cache.sizing.traces import Trace, TraceError, load_trace  # imports NumPy

    if request.trace:
        try:
            full = load_trace(request.trace)
        except (TraceError, OSError, ValueError) as error:
            _fail(f"--trace {request.trace}: {error}")
        if full.num_experts != model.routed_experts:
            _fail(f"--trace {request.trace} routes over {full.num_experts} experts per layer; "
                  f"{model.name} has {model.routed_experts}")
        if asked is not None and full.num_layers < asked:
            _fail(f"--trace {request.trace} has {full.num_layers} layers, fewer than --layers "
                  f"{asked}")
        layers = asked or min(most, full.num_layers)
        dense = full.to_dense()
        if dense.shape[0] < tokens:
            _fail(f"--trace {request.trace} has {dense.shape[0]} tokens, fewer than --tokens "
                  f"{tokens}")
        return Trace.from_dense(dense[:tokens, :layers], num_experts=full.num_experts,
                                source=f"{full.source}[:{tokens}, :{layers}]"), layers
    from pallas_cache.sizing.synthetic import PRESETS, synthetic_trace

    layers = asked or most
    name = request.synthetic or DEFAULT_PRESET
    params = dataclasses.replace(PRESETS[name], num_layers=layers,
                                 num_experts=model.routed_experts, top_k=model.top_k,
                                 num_tokens=tokens)
    trace = synthetic_trace(params, seed=request.seed)
    return Trace.from_dense(trace.to_dense(), num_experts=model.routed_experts,
                            source=f"synthetic:{name}(layers={layers}, tokens={tokens}, "
                                   f"seed={request.seed})"), layers


def _cache_sizes(texts, geometry) -> tuple:
    """The pools' slots: each in ``[E, L*E]`` (``replay --cache-size``'s spellings, no auto)."""
    g = geometry
    if texts is None:
        base = g.num_layers * g.top_k
        return tuple(sorted({min(max(s, g.num_experts), g.resident_slots)
                             for s in (base, round(1.5 * base))}))
    sizes = []
    for text in texts:
        if text.isascii() and text.isdigit():
            slots = int(text)
        else:
            try:
                slots = parse_bytes(text) // g.expert_bytes
            except ValueError:
                _fail(f"cache size {text!r} is not a slot count (ASCII digits) or bytes such "
                      f"as 12GiB")
        if not g.num_experts <= slots <= g.resident_slots:
            _fail(f"cache size {text} is {slots} slots, outside [{g.num_experts}, "
                  f"{g.resident_slots}] (one layer's experts to every expert of L={g.num_layers})")
        sizes.append(slots)
    return tuple(dict.fromkeys(sizes))


def _configurations(policies, evictions) -> tuple:
    """``(policy, eviction)`` pairs: the default trio, or every pair asked."""
    from pallas_cache.sizing.sweep import parse_policy

    if policies is None and evictions is None:
        return (("full", "lru"), ("full", "route_knn"), ("fraction:auto", "lru"))
    policies = policies or ["full", "fraction:auto"]
    for policy in policies:
        if policy != "fraction:auto":
            try:
                parse_policy(policy)
            except ValueError as error:
                _fail(str(error))
    return tuple((p, e) for e in (evictions or ["lru"]) for p in policies)


def _device_facts():
    """``(platform, free device bytes or None)`` of the default device."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return "cpu", None
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    limit = stats.get("bytes_limit")
    free = None if limit is None else int(0.9 * limit) - stats.get("bytes_in_use", 0)
    return device.platform, free


def plan_and_run(request: DecodeRequest):
    """``(plan, run)``: every refusal first (a :class:`UsageError`), then the decode, progress
    on stderr unless ``request.quiet``."""

    def progress(line: str) -> None:
        if not request.quiet:
            print(f"pallas-cache: bench-decode: {line}", file=sys.stderr, flush=True)

    platform, device_memory = _device_facts()
    plan = plan_run(request, platform, device_memory)
    for line in plan.lines:
        progress(line)
    from pallas_cache.sizing.decode import bench_decode

    return plan, bench_decode(plan.geometry, plan.trace, plan.cache_sizes, plan.configurations,
                              repeats=request.repeats, rounds=request.rounds,
                              time_limit=request.time_limit, seed=request.seed,
                              resident=plan.floor, no_cache=request.no_cache, progress=progress)


def run_bench_decode(request: DecodeRequest) -> int:
    """``pallas-cache bench-decode``: plan, decode, print the rows (a table or JSON)."""
    plan, run = plan_and_run(request)
    if request.format == "json":
        print(json.dumps([row.as_dict() for row in run.rows], indent=1))
    else:
        print(format_run(run, plan.lines))
    return 0


def format_run(run, header_lines=(), *, markdown: bool = False) -> str:
    """The table and its notes, as text (``markdown``: a Markdown table, the notes as a list)."""
    p = run.parameters
    import jax

    device = jax.devices()[0]
    lines = list(header_lines) + [
        f"routes: {run.trace_source}, {run.tokens} tokens; device {device.platform}:{device.id} "
        f"({device.device_kind}); bank in {run.bank_memory} memory",
        f"left out: {run.notes[0]}",
        f"measured: B_link {format_bandwidth(p.copy_bandwidth)} (copy path), B_cpu "
        f"{format_bandwidth(p.cpu_bandwidth)}, T_cpu {p.cpu_fixed_seconds * 1e3:.4g} ms, A "
        f"{p.gpu_layer_seconds * 1e3:.4g} ms, C {p.gpu_expert_seconds * 1e3:.4g} ms",
        *(f"  {line}" for line in p.lines), ""]
    header = ["row", "measured ms/tok", "tok/s", "fetched/tok", "CPU experts/tok", "compile s",
              "modeled ms/tok", "measured/modeled"]
    cells = [[r.row, f"{r.measured_ms_per_token:.3f}", f"{r.tokens_per_second:.2f}",
              f"{r.fetched_per_token:.3f}", f"{r.cpu_experts_per_token:.3f}",
              f"{r.compile_seconds:.1f}", f"{r.modeled_ms_per_token:.3f}",
              f"{r.measured_over_modeled:.2f}"] for r in run.rows]
    if markdown:
        lines = [f"- {line.strip()}" for line in lines if line]
        lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
    else:
        widths = [max(len(str(c)) for c in column) for column in zip(header, *cells)]
        for row in [header] + cells:
            lines.append("  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))))
    lines += ["", "counts: every row's per-call (hits, fetched, cpu_experts) equal the replay's "
              "on the same routes (floor and no-cache: the trace's distinct experts per call)",
              f"model: {run.notes[1]}"] + [f"left out: {note}" for note in run.notes[2:]]
    lines += [f"gap: {line}" for line in run.gaps] or ["gap: every row within 15% of its model"]
    return "\n".join(lines)
