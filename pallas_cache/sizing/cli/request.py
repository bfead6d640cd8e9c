"""``pallas-cache replay``'s request: the parser's namespace turned, once, into one frozen record
of library types (:class:`ReplayRequest`) by :func:`build_request`, which runs every check the
command line alone decides, before any trace is read or generated, and raises one
:class:`~pallas_cache.sizing.cli.parser.UsageError` (the one line the CLI prints, exit 2)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pallas_cache.evictions import Eviction
from pallas_cache.policy import Admission, FetchOrder
from pallas_cache.sizing import synthetic
from pallas_cache.sizing.cli import checks
from pallas_cache.sizing.cli.devices import check_device_count, device_cost
from pallas_cache.sizing.cli.parser import (DEFAULT_POLICIES, DEFAULT_PRESET,
                                            DEFAULT_TIMED_POLICIES, UsageError)
from pallas_cache.sizing.cli.sizes import CacheSize
from pallas_cache.sizing.models import MoEModel, resolve_model
from pallas_cache.sizing.sweep.cost import CostModel
from pallas_cache.sizing.traces import (RUN_FIXED_BYTES, ProcessBudget, TraceError,
                                        default_memory_limit, parse_fields)
from pallas_cache.sizing.units import (format_bytes, parse_bandwidth, parse_bytes,
                                       parse_duration)

__all__ = ["CacheSize", "Output", "ReplayRequest", "SyntheticSource", "TraceFile",
           "build_request", "process_budget"]

#: What a check raises for a command line it refuses (each becomes one line).
REFUSED = (TraceError, OSError, KeyError, TypeError, ValueError)


@dataclasses.dataclass(frozen=True)
class TraceFile:
    """A ``--trace`` file (or vLLM directory): its format (``auto`` or a registry name), the
    file's names of the record keys, and the declared geometry (``None``: inferred)."""

    path: str
    format: str = "auto"
    fields: Mapping[str, str] | None = None
    num_layers: int | None = None
    num_experts: int | None = None


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """A generated trace: the preset, its length and seed, the geometry that differs from the
    preset's (``num_layers``, ``num_experts``, ``top_k``), and the requests it is cut into."""

    preset: str = DEFAULT_PRESET
    tokens: int | None = None
    seed: int = 0
    geometry: Mapping[str, int] = dataclasses.field(default_factory=dict)
    requests: int | None = None


@dataclasses.dataclass(frozen=True)
class Output:
    """How the rows are shown: ``format`` (one of ``report.FORMATS``), the plot's file, no
    progress (``quiet``), the legend's route_knn line, the hit rates per layer."""

    format: str = "table"
    plot: str | None = None
    quiet: bool = False
    knn_legend: bool = False
    per_layer: bool = False


@dataclasses.dataclass(frozen=True)
class ReplayRequest:
    """What ``pallas-cache replay`` was asked, checked.

    Attributes:
      source: a :class:`TraceFile` or a :class:`SyntheticSource`.
      cache_sizes: the ``--cache-size`` values, in order, each read once (its slots at the
        cost model's ``W``; :func:`~pallas_cache.sizing.cli.sizes.resolve_sizes` places them at
        a trace's geometry).
      policies: ``--policy`` as given (``None``: the defaults of the cost model).
      orders, admissions, evictions: the sweep's axes, enum members (``config_grid`` takes
        them as they are).
      cost: the cost model of one device (``W / T`` per slot tensor-parallel, ``B_cpu / D``).
      model: the ``--model``, if any; ``weight_label`` says what ``W`` is.
      devices, parallel: ``--devices D --parallel expert|tensor`` (``None``: one device).
      batches: ``--batch`` sizes, distinct (``None``: one token per call).
      max_memory: what the process may take, less a minimal run's own.
      output: how the rows are shown.
      auto_k: the routes per call ``fraction:auto`` balances with a fixed CPU cost (``None``:
        none needed; 0: a trace file's, known once it is read).
    """

    source: TraceFile | SyntheticSource
    cache_sizes: tuple[CacheSize, ...]
    policies: tuple[str, ...] | None
    orders: tuple[FetchOrder, ...]
    admissions: tuple[Admission, ...]
    evictions: tuple[Eviction, ...]
    cost: CostModel
    model: MoEModel | None
    weight_label: str | None
    devices: int | None
    parallel: str | None
    batches: tuple[int, ...] | None
    max_memory: ProcessBudget
    output: Output
    auto_k: int | None

    @property
    def axes(self) -> tuple[tuple[FetchOrder, ...], tuple[Admission, ...], tuple[Eviction, ...]]:
        """``(orders, admissions, evictions)``, the sweep's axes after the cache size and the
        policy, in ``config_grid``'s order."""
        return self.orders, self.admissions, self.evictions

    @property
    def lru_only(self) -> bool:
        return set(self.evictions) == {Eviction.LRU}

    def resolved_policies(self, top_k: int | None) -> tuple[list[str], list[str]]:
        """``(requested, policies)``: the policy texts with ``fraction:auto`` resolved at
        ``top_k`` routes per call (docs/semantics.md §11.4), and those as the fractions they run
        (clamped), distinct."""
        requested = resolve_policies(self.policies, self.cost, top_k)
        return requested, list(dict.fromkeys(checks.clamped(policy) for policy in requested))


def resolve_policies(requested, cost: CostModel, top_k=None) -> list[str]:
    """The policy list with ``fraction:auto`` resolved (docs/semantics.md §11.4; with a fixed
    CPU cost it depends on ``top_k``, the routes per call)."""
    if requested is None:
        requested = DEFAULT_TIMED_POLICIES if cost.link_bandwidth and cost.cpu_bandwidth \
            else DEFAULT_POLICIES
    resolved = [cost.auto_policy(top_k) if p == "fraction:auto" else p for p in requested]
    return list(dict.fromkeys(resolved))


def build_request(args) -> ReplayRequest:
    """The :class:`ReplayRequest` of the ``replay`` subcommand's namespace, after every check
    the flags alone decide (docs/replay.md), in the order a user meets them.

    Raises:
      UsageError: the first refusal, as the one line the CLI prints.
    """
    try:
        return _build(args)
    except REFUSED as error:
        raise UsageError(f"pallas-cache: {error}") from None


def _build(args) -> ReplayRequest:
    max_memory = process_budget(args.max_memory)
    if args.field is not None and not args.trace:
        raise ValueError("--field names the keys of a JSONL or Parquet --trace")
    fields = parse_fields(args.field) if args.field is not None else None
    output = Output(args.format or ("json" if args.json else "table"),
                    checks.check_plot_path(args.plot) if args.plot else None, args.quiet,
                    args.knn_legend, args.per_layer)
    cost, model, label = cost_options(args)
    cost = device_cost(args.devices, args.parallel, output.plot is not None, cost)
    if args.trace is not None:
        if args.top_k is not None:
            raise ValueError("--top-k applies to a synthetic trace; a --trace's routes give its "
                             "top-k")
        source = TraceFile(args.trace, args.trace_format, fields, args.num_layers,
                           args.num_experts)
    else:
        source = SyntheticSource(args.synthetic or DEFAULT_PRESET, args.tokens, args.seed,
                                 synthetic_geometry(args), args.requests)
    check_device_count(args.devices, args.parallel, declared_experts(source))
    batched = batches(args)
    if batched and args.devices is not None:
        raise ValueError(f"--batch replays one device's cache; it does not combine with "
                         f"--devices {args.devices}")
    orders = tuple(FetchOrder.coerce(o) for o in args.order)
    admissions = tuple(Admission.coerce(a) for a in args.admission)
    evictions = tuple(Eviction.coerce(e) for e in args.eviction)
    if output.knn_legend:
        checks.check_knn_legend(output.format, evictions, batched, args.parallel)
    if output.per_layer:
        checks.check_per_layer(batched, args.parallel)
    auto_k = _auto_top_k(source, cost, max_memory)
    request = ReplayRequest(
        source, (), None if args.policy is None else tuple(args.policy), orders, admissions,
        evictions, cost, model, label, args.devices, args.parallel,
        None if batched is None else tuple(batched), max_memory, output, auto_k)
    # fraction:auto with a fixed CPU cost waits for a trace file's routes per call (auto_k 0);
    # until then the policies are checked as resolved at one route per call
    _, policies = request.resolved_policies(1 if auto_k == 0 else auto_k)
    if args.trace and args.tokens is not None:  # ('' is refused below as an empty path)
        raise ValueError(f"--tokens {args.tokens} sets the length of a --synthetic trace; a "
                         f"--trace file has its own tokens")
    checks.check_source(args.trace, args.num_layers, args.num_experts)
    sizes = tuple(CacheSize.parse(text, cost.expert_bytes) for text in args.cache_size)
    checks.check_sweep(cost, policies, request.axes)
    return dataclasses.replace(request, cache_sizes=sizes)


def process_budget(max_memory: int | None) -> ProcessBudget:
    """``--max-memory`` (``None``: the default limit) as what it leaves for the inputs: the limit
    covers the whole process, so a minimal run's :data:`RUN_FIXED_BYTES` comes off it. A limit
    below that is refused (ValueError, one line), before anything is read."""
    if isinstance(max_memory, ProcessBudget):
        return max_memory
    given = max_memory is not None
    limit = max_memory if given else default_memory_limit()
    if limit < RUN_FIXED_BYTES:
        what = (f"--max-memory {format_bytes(limit)}" if given else
                f"the default memory limit ({format_bytes(limit)}, half of this machine's memory)")
        raise ValueError(f"{what} is below the {format_bytes(RUN_FIXED_BYTES)} a minimal replay "
                         f"takes (the interpreter, JAX and XLA); give --max-memory "
                         f"{format_bytes(RUN_FIXED_BYTES)} or more")
    return ProcessBudget.of(limit)


def cost_options(args) -> tuple[CostModel, MoEModel | None, str | None]:
    """``(CostModel, model or None, what W is or None)`` from the flags; ValueError names the
    bad one."""
    model = label = None
    width = None
    if args.model:
        model, dtype = resolve_model(args.model)
        width = model.expert_bytes(dtype)
        label = model.weight_label(dtype)
    elif args.expert_bytes:
        width = parse_bytes(args.expert_bytes)
        label = f"W = {format_bytes(width)} ({width} bytes)"
    link = parse_bandwidth(args.link_bandwidth) if args.link_bandwidth else None
    cpu = parse_bandwidth(args.cpu_bandwidth) if args.cpu_bandwidth else None
    budget = parse_bytes(args.device_budget) if args.device_budget else None
    cost = CostModel(width, link, cpu, budget)
    cost = CostModel(width, link, cpu, budget, cpu_fixed_seconds(args.cpu_fixed_cost, cost.timed))
    layer_seconds, expert_seconds = gpu_seconds(args, cost)
    if layer_seconds is not None or expert_seconds is not None:
        cost = dataclasses.replace(cost, gpu_layer_seconds=layer_seconds,
                                   gpu_expert_seconds=expert_seconds)
    if budget is not None and not cost.timed:
        raise ValueError("--device-budget needs an expert size (--model or --expert-bytes) and "
                         "both --link-bandwidth and --cpu-bandwidth")
    return cost, model, label


def cpu_fixed_seconds(text: str | None, timed: bool) -> float:
    """``--cpu-fixed-cost`` in seconds (0 when not given); ``timed``: whether ``W`` and both
    bandwidths are known, without which the flag does not apply (an error naming it)."""
    if text is None:
        return 0.0
    try:
        seconds = parse_duration(text)
    except ValueError as error:
        raise ValueError(f"--cpu-fixed-cost: {error}") from None
    if not timed:
        raise ValueError("--cpu-fixed-cost needs an expert size (--model or --expert-bytes) and "
                         "both --link-bandwidth and --cpu-bandwidth")
    return seconds


#: The GPU-time flags, as (attribute, flag).
_GPU_FLAGS = (("gpu_layer_ms", "--gpu-layer-ms"), ("gpu_expert_ms", "--gpu-expert-ms"))


def gpu_seconds(args, cost: CostModel) -> tuple[float | None, float | None]:
    """``(A, C)`` in seconds from ``--gpu-layer-ms`` and ``--gpu-expert-ms`` (``None`` for a
    flag not given; ``(None, None)``: no GPU-time model). Refuses, naming the flag, a bad
    value, a missing expert size or link bandwidth, and ``--devices`` above 1."""
    given = [(flag, getattr(args, name)) for name, flag in _GPU_FLAGS]
    if all(text is None for _, text in given):
        return None, None
    values = [None if text is None else checks.milliseconds(flag, text) for flag, text in given]
    flag = next(flag for flag, text in given if text is not None)
    if cost.expert_bytes is None or cost.link_bandwidth is None:
        raise ValueError(f"{flag} needs an expert size (--model or --expert-bytes) and "
                         f"--link-bandwidth")
    if args.devices is not None and args.devices > 1:
        raise ValueError(f"{flag} times one device's decode; it does not combine with "
                         f"--devices {args.devices} (yet)")
    return values[0], values[1]


_GEOMETRY_FLAGS = (("num_layers", "--num-layers", "moe_layers", "MoE layers"),
                   ("num_experts", "--num-experts", "routed_experts", "routed experts"),
                   ("top_k", "--top-k", "top_k", "top-k"))


def synthetic_geometry(args) -> dict:
    """The geometry a synthetic trace (named by ``--synthetic``, or the default one) is
    generated with: ``{"num_layers": L, "num_experts": E, "top_k": k}`` for the fields that
    differ from the preset, from ``--model`` (its MoE layers, routed experts and top-k) and the
    explicit ``--num-layers`` / ``--num-experts`` / ``--top-k``.

    Raises ValueError naming the flag: an explicit count that contradicts ``--model``'s; a
    count below 1; a top-k above the experts."""
    geometry = {}
    model = resolve_model(args.model)[0] if args.model else None
    for field, flag, model_field, what in _GEOMETRY_FLAGS:
        value = getattr(args, field)
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
        if model is not None:
            theirs = getattr(model, model_field)
            if value is not None and value != theirs:
                raise ValueError(f"{flag} {value} contradicts --model {model.name} ({theirs} "
                                 f"{what}); give one or the other (--expert-bytes sets W "
                                 f"without a geometry)")
            value = theirs
        if value is not None:
            geometry[field] = value
    preset = synthetic.PRESETS.get(args.synthetic or DEFAULT_PRESET)
    if preset is not None:
        experts = geometry.get("num_experts", preset.num_experts)
        top_k = geometry.get("top_k", preset.top_k)
        if top_k > experts:  # a model's own geometry never does this: explicit flags only
            raise ValueError(f"--top-k {top_k} exceeds --num-experts {experts} (the experts per "
                             f"layer of the synthetic trace)")
    return geometry


def declared_experts(source) -> int | None:
    """The experts per layer known before the trace is read: a synthetic trace's (its preset's,
    or ``--model``'s / ``--num-experts``'), a ``--trace``'s declared ``--num-experts``; else
    ``None`` (known once it is read)."""
    if isinstance(source, TraceFile):
        return source.num_experts
    preset = synthetic.PRESETS.get(source.preset)
    return source.geometry.get("num_experts",
                               preset.num_experts if preset is not None else None)


def batches(args) -> list[int] | None:
    """``--batch``'s sizes, distinct, in the order given; ``None`` when the replay is not batched
    (no ``--batch``, or ``--batch 1``: one token per call, the plain replay). Checks
    ``--requests`` too (ValueError naming the flag)."""
    if args.requests is not None:
        if args.trace:
            raise ValueError("--requests applies to a synthetic trace; a --trace's sequences "
                             "are its requests")
        if args.requests < 1:
            raise ValueError(f"--requests {args.requests}: must be at least 1")
    if args.batch is None:
        return None
    bad = [size for size in args.batch if size < 1]
    if bad:
        raise ValueError(f"--batch {bad[0]}: must be at least 1")
    sizes = list(dict.fromkeys(args.batch))
    return None if sizes == [1] else sizes


def synthetic_params(source: SyntheticSource, max_memory: int):
    """The synthetic trace's parameters, checked against ``max_memory`` (before it is
    generated)."""
    params, _ = synthetic.checked_params(source.preset, source.tokens, source.seed,
                                         max_memory=max_memory, geometry=dict(source.geometry))
    return params


def _auto_top_k(source, cost: CostModel, max_memory: int) -> int | None:
    """The routes per call ``fraction:auto`` balances with a fixed CPU cost: ``None`` without
    one (the rule needs none), the synthetic trace's ``min(top_k, E)``, or 0 for a trace file
    (known once it is read)."""
    if not cost.cpu_fixed_seconds:
        return None
    if isinstance(source, TraceFile):
        return 0
    params = synthetic_params(source, max_memory)
    return min(params.top_k, params.num_experts)
