"""The ``pallas-cache`` command: size an expert cache by replaying routing traces.

``pallas-cache replay`` with no arguments replays the embedded synthetic ``mixtral-realistic``
trace through a grid of cache sizes and policies and prints, for each configuration, the hit rate
next to the offline bounds; given an expert size (``--model`` or ``--expert-bytes``) and the two
bandwidths it also prints bytes and modeled milliseconds per token and the best configuration
(docs/semantics.md §11). ``pallas-cache scenarios`` prints the promotion scenarios' table computed
by the library. The console script (:func:`console_main`) keeps JAX's compiled programs in the
user's cache directory, so a rerun skips compiling; :func:`main`, called in-process, never does.

(Why one module of ~500 lines: it is the argument parser, the checks that fail before the
work, and the help text with its column legend, all of which must agree on every flag; the
records, formats and plot it prints live in report.py and plotting.py.)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import stat
import sys
import tempfile
import textwrap
import threading
import time

from pallas_cache.sizing import synthetic
from pallas_cache.sizing.cost import CostModel
from pallas_cache.sizing.models import MODELS, resolve_model
from pallas_cache.sizing.progress import Bar, Progress
from pallas_cache.sizing.report import FORMATS, format_records, legend_text, records
from pallas_cache.sizing.traces import (FIELD_KEYS, TRACE_FORMATS, TraceError, check_memory,
                                       default_memory_limit, load_trace, parse_fields)
from pallas_cache.sizing.units import format_bandwidth, format_bytes, parse_bandwidth, parse_bytes

DEFAULT_PRESET = "mixtral-realistic"
DEFAULT_POLICIES = ("full", "fraction:0.4")
#: The default policies once both bandwidths are known: the balanced split joins them.
DEFAULT_TIMED_POLICIES = ("full", "fraction:auto", "fraction:0.4")
#: File written inside a directory given to ``--plot``.
DEFAULT_PLOT_NAME = "hit_rate.png"
#: Calls per compiled chunk of the legend's route_knn scan (a Ctrl-C waits at most one).
_COMPANION_CHUNK = 4096
#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
#: Set to anything but ``""`` or ``"0"`` to keep the console script off JAX's persistent
#: compilation cache (as ``--no-compile-cache`` does).
NO_COMPILE_CACHE_ENV = "PALLAS_CACHE_NO_COMPILE_CACHE"

REPLAY_HELP = r"""
Replay a routing trace through a grid of cache configurations and report, for each one, how
often the routed experts were already on the device.

  pallas-cache replay                                   # the embedded mixtral-realistic trace
  pallas-cache replay --model mixtral-8x7b --link-bandwidth 25GB/s --cpu-bandwidth 60GB/s
  pallas-cache replay --model mixtral-8x7b:fp8 --cache-size 12GiB 24GiB --device-budget 20GiB \
                      --link-bandwidth 25GB/s --cpu-bandwidth 60GB/s
  pallas-cache replay --synthetic fine-grained --cache-size 256 1024 2048
  pallas-cache replay --trace routes.jsonl --cache-size 64 128 --policy full fraction:0.4 cap:1
  pallas-cache replay --order recency lowest_id --admission promote_one none --json
  pallas-cache replay --format csv > sweep.csv          # or json, jsonl, markdown

Trace files: JSONL, one record per (token, layer):
  {"layer": 3, "token_idx": 17, "experts": [5, 1], "sequence": "prompt-42"}
(gzipped is fine; other key names: --field layer=layer_idx,experts=topk_ids); the same columns
in .parquet (experts: list<int>; needs pip install 'pallas-cache[parquet]'); or a .npy/.npz
integer array [tokens, layers, top_k] (-1 = padding; each array of an .npz is one sequence).
From vLLM (--enable-return-routed-experts): a directory with one .npy per request,
  np.save(f"routes/{out.request_id}.npy", out.outputs[0].routed_experts)
(or an .npz of them with --trace-format vllm); each request is one sequence.
From transformers router logits: np.save("routes.npy",
  pallas_cache.sizing.routes_from_router_logits(out.router_logits, top_k)).
From a JAX decode loop: pallas_cache.sizing.trace_from_routes or RouteRecorder (docs/replay.md).

hit_rate = 1 - missing/active, counted per layer-call over distinct experts. The bounds:
  belady_hit_rate          the offline optimum when every miss is admitted (evict the resident
                           used furthest in the future): it bounds `full` rows only; a hybrid
                           row may beat it.
  bypass_optimum_hit_rate  the offline optimum when a miss may be served without being admitted
                           (e.g. on the CPU): it bounds every row.
  oracle_hit_rate          the best a fixed set of max(1, round(S/L)) slots per layer could do on
                           this traffic; not a bound (below S = L it uses more than S slots).

Cost model (docs/semantics.md §11): with W the bytes of one expert (--model or --expert-bytes),
a layer-call that copies `fetched` experts while the CPU computes `cpu_experts` distinct ones
takes max(fetched*W/B_link, cpu_experts*W/B_cpu); a token, the sum over its layer-calls.
modeled_ms_per_token leaves out GPU compute, attention, dense layers and launch latency.
best marks the fastest row at each cache size; --device-budget names the fastest that fits.
Sizes: auto = max(E, L*k) .. L*E in steps of x1.41; rows below L*k are flagged in `note`.
Bytes and bandwidths: 336MiB, 24GiB, 12GB; 25GB/s, 12GiB/s, 800MB/s (GB = 10^9 bytes).
Models: """ + ", ".join(MODELS) + """ (NAME:DTYPE for bf16, fp16, fp32, fp8, int8, int4).

Columns (the keys of every record; json, jsonl and csv carry all of them, table and markdown
the informative ones; an absent value is null in json, empty in csv, - in a table):
""" + legend_text(96) + "\n"


class _UsageError(Exception):
    """A command line argparse refuses, as the one line the CLI prints."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a refused command line as one line (no usage block) and exit 2."""

    def error(self, message):
        raise _UsageError(f"pallas-cache: {message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pallas-cache",
        description="Plan and size the GPU expert slot cache of offloaded MoE inference.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _Parser(add_help=False)
    common.add_argument("--no-compile-cache", action="store_true",
                        help="do not keep compiled programs in "
                             "$XDG_CACHE_HOME/pallas-cache/jax (default ~/.cache/pallas-cache/jax"
                             f"; also {NO_COMPILE_CACHE_ENV}=1)")

    replay = commands.add_parser(
        "replay", help="replay a routing trace through cache configurations",
        description=REPLAY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common])
    source = replay.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="PATH",
                        help="a .jsonl, .npy, .npz or .parquet routing trace, or a directory of "
                             "vLLM routed-experts .npy files (one per request)")
    source.add_argument("--synthetic", metavar="PRESET", choices=sorted(synthetic.PRESETS),
                        help=f"a generated trace: {', '.join(sorted(synthetic.PRESETS))} "
                             f"(default: {DEFAULT_PRESET})")
    replay.add_argument("--tokens", type=int, default=None,
                        help="tokens to generate for --synthetic (default: the preset's)")
    replay.add_argument("--seed", type=int, default=0, help="seed for --synthetic (default: 0)")
    replay.add_argument("--trace-format", choices=("auto",) + TRACE_FORMATS, default="auto",
                        help="how to read --trace: auto (a directory is vllm, else the suffix "
                             "decides), jsonl, array (.npy/.npz [tokens, layers, top_k]), vllm "
                             "(the array layout, one request per file or .npz array, every "
                             "request the same layers and top_k) or parquet (default: auto)")
    replay.add_argument("--field", metavar="KEY=NAME[,...]", default=None,
                        help="the names a JSONL or Parquet --trace uses for the record keys "
                             f"({', '.join(FIELD_KEYS)}), e.g. layer=layer_idx,experts=topk_ids")
    replay.add_argument("--num-layers", type=int, default=None,
                        help="declared layer count of --trace (default: inferred)")
    replay.add_argument("--num-experts", type=int, default=None,
                        help="declared experts per layer of --trace (default: inferred)")
    replay.add_argument("--cache-size", nargs="+", metavar="SIZE", default=["auto"],
                        help="pool sizes: auto (max(E, L*k) up to L*E in steps of x1.41), N "
                             "slots (>= experts per layer), or bytes such as 12GiB (needs "
                             "--model or --expert-bytes; rounded down to whole slots) "
                             "(default: auto)")
    replay.add_argument("--policy", nargs="+", default=None, metavar="P",
                        help="full | fraction:Q | fraction:auto | cap:N (default: full "
                             "fraction:0.4, plus fraction:auto when both bandwidths are given); "
                             "fraction:auto = B_link/(B_link+B_cpu)")
    weight = replay.add_mutually_exclusive_group()
    weight.add_argument("--model", metavar="NAME[:DTYPE]",
                        help=f"take the expert size W from a model: {', '.join(MODELS)} "
                             f"(dtype default bf16)")
    weight.add_argument("--expert-bytes", metavar="SIZE",
                        help="bytes of one routed expert, e.g. 336MiB")
    replay.add_argument("--link-bandwidth", metavar="RATE",
                        help="host-to-device copy bandwidth B_link, e.g. 25GB/s")
    replay.add_argument("--cpu-bandwidth", metavar="RATE",
                        help="expert bytes per second the CPU MoE path processes, B_cpu, "
                             "e.g. 60GB/s")
    replay.add_argument("--device-budget", metavar="SIZE",
                        help="device memory for the pool, e.g. 24GiB: names the fastest "
                             "configuration whose cache_bytes fits (needs W and both bandwidths)")
    replay.add_argument("--order", nargs="+", default=["recency"], choices=["recency", "lowest_id"],
                        help="which misses win a capped fetch (default: recency)")
    replay.add_argument("--admission", nargs="+", default=["promote_one"],
                        choices=["promote_one", "none", "reuse"],
                        help="fetches beyond the split (default: promote_one)")
    replay.add_argument("--eviction", nargs="+", default=["lru"],
                        choices=["lru", "pair_lfu", "route_knn", "route_lfu"],
                        help="which resident a fetch evicts (default: lru); reuse is swept "
                             "with lru only. route_knn is what wins on real Mixtral routing: "
                             "the best hit rate at every size on Mixtral-8x7B HumanEval and "
                             "GSM8K decode traces (21-51%% of the LRU->Belady gap); its step "
                             "costs about 4x LRU's per call at Mixtral's geometry and 8-12x at "
                             "a fine-grained one (XLA:CPU, by load; benchmarks/RESULTS.md), small "
                             "beside an expert copy. Check it on your trace: --eviction lru "
                             "route_knn (an lru-only table's legend gives the difference)")
    output = replay.add_mutually_exclusive_group()
    output.add_argument("--format", choices=FORMATS, default=None,
                        help="table (default), json (a list of records), jsonl (one record per "
                             "line), csv (stdlib csv; pair_counts as one JSON cell) or markdown; "
                             "every format uses the record keys listed above")
    output.add_argument("--json", action="store_true", help="the same as --format json")
    replay.add_argument("--plot", metavar="FILE.png",
                        help="draw hit rate and per-token traffic against cache size "
                             "(pallas_cache.sizing.plot; needs matplotlib); a directory "
                             f"gets {DEFAULT_PLOT_NAME} inside it")
    replay.add_argument("--max-memory", type=_memory_size, default=None, metavar="BYTES",
                        help="refuse a trace, synthetic size or cache state estimated above this "
                             "(e.g. 8GiB, 512MiB, 2e9; default: half the machine's memory)")
    replay.add_argument("-q", "--quiet", action="store_true",
                        help="no progress on stderr (warnings and errors still go there)")

    commands.add_parser("scenarios", help="print the promotion scenarios' table", parents=[common])

    bench = commands.add_parser(
        "bench-bandwidth", help="measure B_link and B_cpu roughly, for replay's cost model",
        description="Measure the host-to-device copy bandwidth (B_link: jax.device_put of pageable "
                    "host memory) and the CPU's expert streaming rate (B_cpu: a one-token float32 "
                    "matrix-vector product over one expert matrix), and print them as replay "
                    "flags. Rough: a serving engine's pinned buffers and CPU kernels differ.",
        parents=[common])
    bench.add_argument("--mib", type=int, default=256,
                       help="MiB copied per B_link measurement (default: 256)")
    bench.add_argument("--d-model", type=int, default=4096, help="expert matrix rows (default: "
                                                                 "4096, Mixtral-8x7B)")
    bench.add_argument("--d-expert", type=int, default=14336,
                       help="expert matrix columns (default: 14336, Mixtral-8x7B)")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs, median (default: 5)")
    return parser


def _load(args, progress: Progress | None = None):
    if args.trace:
        fields = parse_fields(args.field) if args.field is not None else None
        report = None if progress is None else _ReadProgress(progress, args.trace)
        return load_trace(args.trace, num_layers=args.num_layers, num_experts=args.num_experts,
                          max_memory=args.max_memory, fields=fields,
                          trace_format=args.trace_format, progress=report)
    return synthetic.synthetic_trace(args.synthetic or DEFAULT_PRESET, num_tokens=args.tokens,
                                     seed=args.seed, max_memory=args.max_memory)


#: Seconds a trace may take to read before its progress is shown (a phase of the replay's).
READ_PROGRESS_AFTER = 2.0


class _ReadProgress:
    """``progress(bytes read, file size)`` of :func:`load_trace` as a phase of the CLI's
    :class:`Progress`, started once the read has taken :data:`READ_PROGRESS_AFTER` seconds."""

    def __init__(self, progress: Progress, path: str):
        self.progress, self.path = progress, path
        self.start, self.shown = time.perf_counter(), False

    def __call__(self, done: int, total: int) -> None:
        if not self.shown:
            if time.perf_counter() - self.start < READ_PROGRESS_AFTER:
                return
            self.progress.phase(f"reading {self.path} ({format_bytes(total)})...", max(total, 1))
            self.shown = True
        self.progress.update(done, f"{format_bytes(done)} of {format_bytes(total)}")


# ---- argument checks: everything that can fail does so before the work ----------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def _memory_size(text: str) -> int:
    """``--max-memory``: ``8GiB``, ``512MiB``, ``2e9``, ``1000000`` -> bytes (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (e.g. 8GiB, 512MiB, "
                                         f"2e9)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive memory size")
    return value


def _check_plot_path(path: str) -> str:
    """The file ``--plot`` will write, checked now: matplotlib importable, a known image format,
    an existing, writable directory, and an existing file there writable and replaceable (the
    plot is renamed over it). A directory gets :data:`DEFAULT_PLOT_NAME` inside it.

    Raises:
        ValueError: the one-line reason.
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pallas-cache[plot]'") from None
    if os.path.isdir(path):
        path = os.path.join(path, DEFAULT_PLOT_NAME)
    elif path.endswith(("/", os.sep)):
        raise ValueError(f"--plot {path}: no such directory")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ValueError(f"--plot {path}: unknown image format "
                         f"{('.' + extension) if extension else '(no extension)'}; use one of "
                         f"{', '.join('.' + f for f in formats)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: no such directory {folder}")
    try:  # a real write: permission bits say nothing to root or on a read-only mount
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".pallas-cache-probe-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"--plot {path}: cannot write in {folder}: "
                         f"{error.strerror or error}") from None
    if os.path.lexists(path):
        if not os.access(path, os.W_OK, follow_symlinks=False):
            raise ValueError(f"--plot {path}: the existing file is not writable")
        try:
            _rename_aside_and_back(path, folder)
        except OSError as error:
            raise ValueError(f"--plot {path}: cannot replace the existing file: "
                             f"{error.strerror or error}") from None
    return path


def _rename_aside_and_back(path: str, folder: str) -> None:
    """Rename the existing ``path`` to a temporary name in ``folder`` and back: the checks a
    rename over it meets (an immutable file, a sticky directory, a read-only mount) are the
    checks this meets, and the file ends where it was, same inode, same bytes."""
    handle, aside = tempfile.mkstemp(dir=folder, prefix=".pallas-cache-probe-")
    os.close(handle)
    try:
        os.replace(path, aside)
    except OSError:
        os.remove(aside)
        raise
    try:
        os.replace(aside, path)
    except OSError as error:
        raise OSError(error.errno, f"{error.strerror}; the file is now {aside}") from None


def _new_file_mode() -> int:
    """The mode a newly created file gets from the process umask (0o644 under umask 022).
    Read from /proc where Linux has it, so the umask is never changed, even for a moment."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _policy_warnings(policies) -> list[str]:
    """One line per ``fraction:Q`` whose clamping or rounding changes what it means
    (docs/semantics.md §5.3: ``q`` clamps to ``[0, 1]`` and is kept in 1/65536 steps)."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.sweep import parse_policy

    lines = []
    for text in policies:
        kind, _, value = str(text).partition(":")
        try:
            requested, f16 = float(value), int(parse_policy(text).fraction16)
        except ValueError:
            continue  # not a fraction, or malformed: config_grid reports it
        if kind != "fraction":
            continue
        if f16 == 0 and requested != 0:
            lines.append(f"pallas-cache: warning: {text} means fetch fraction 0 (q clamps to "
                         f"[0, 1] in steps of 1/{ONE}): the split fetches no miss")
        elif f16 == ONE and requested > 1:
            lines.append(f"pallas-cache: warning: {text} means fetch fraction 1 (q clamps to "
                         f"[0, 1]): the split fetches every miss, as 'full'")
    return lines


#: Bytes of one cache state per flat id (slot map, recency, routing histogram and prefill
#: snapshot: int32 [L, E] each) and per slot (id_of_slot, usage: int32 [S] each).
_STATE_BYTES_PER_ID = 16
_STATE_BYTES_PER_SLOT = 8


def _check_state_memory(sizes, configs_per_size: int, num_layers: int, num_experts: int,
                        limit: int) -> None:
    """Refuse cache sizes whose replay state would exceed ``limit``, before any is allocated.

    A bucket of sizes replays its ``n`` configurations (``configs_per_size`` per size) as one
    batch of states at the bucket's largest size (``sweep.capacity_buckets``): the stacked
    states, the program's output batch and the initial state, ``2 * n + 1`` states in all.
    """
    from pallas_cache.sizing.sweep import capacity_buckets  # after config_grid's jax import

    for bucket in reversed(capacity_buckets(sizes)):
        size, count = bucket[-1], configs_per_size * len(bucket)
        state = (num_layers * num_experts * _STATE_BYTES_PER_ID + size * _STATE_BYTES_PER_SLOT
                 + num_layers * 16)
        check_memory((2 * count + 1) * state, limit, f"--cache-size {size}",
                     f"{count} cache state(s) of {size} slots for {num_layers} "
                     f"layers x {num_experts} experts")


def _cost_options(args):
    """``(CostModel, model label or None)`` from the flags; ValueError names the bad one."""
    model = label = None
    width = None
    if args.model:
        model, dtype = resolve_model(args.model)
        width = model.expert_bytes(dtype)
        label = (f"{model.name} {dtype}: W = 3 x {model.d_model} x {model.d_expert} x "
                 f"{width * 8 // (3 * model.d_model * model.d_expert)} bits = {format_bytes(width)}")
    elif args.expert_bytes:
        width = parse_bytes(args.expert_bytes)
        label = f"W = {format_bytes(width)} ({width} bytes)"
    link = parse_bandwidth(args.link_bandwidth) if args.link_bandwidth else None
    cpu = parse_bandwidth(args.cpu_bandwidth) if args.cpu_bandwidth else None
    budget = parse_bytes(args.device_budget) if args.device_budget else None
    cost = CostModel(width, link, cpu, budget)
    if budget is not None and not cost.timed:
        raise ValueError("--device-budget needs an expert size (--model or --expert-bytes) and "
                         "both --link-bandwidth and --cpu-bandwidth")
    return cost, model, label


def _model_mismatch(model, trace) -> str | None:
    """A warning when the trace's geometry is not the model's, else ``None``."""
    ours = (trace.num_layers, trace.num_experts, trace.top_k)
    theirs = (model.moe_layers, model.routed_experts, model.top_k)
    if ours == theirs:
        return None
    return (f"pallas-cache: warning: the trace has {ours[0]} layers x {ours[1]} experts, "
            f"top-{ours[2]}, but {model.name} has {theirs[0]} MoE layers x {theirs[1]} routed "
            f"experts, top-{theirs[2]}: W comes from the model, the routing from the trace")


def _sizes(texts, trace, cost):
    """``(slot counts, lines saying how byte sizes were rounded)`` from ``--cache-size``."""
    from pallas_cache.sizing.sweep import auto_cache_sizes

    sizes, shown = [], []
    for text in texts:
        if text == "auto":
            sizes += auto_cache_sizes(trace.num_layers, trace.num_experts, trace.top_k)
        elif text.isdigit():
            sizes.append(int(text))
        elif re.fullmatch(r"\s*-\s*[0-9.]+\s*[a-zA-Z]*\s*", text):
            raise ValueError(f"cache size {text!r} must be positive: a slot count (at least one "
                             f"layer's experts) or bytes such as 12GiB")
        else:
            wanted = parse_bytes(text)
            if cost.expert_bytes is None:
                raise ValueError(f"cache size {text!r} is in bytes: give --model or "
                                 f"--expert-bytes to turn it into slots")
            slots = wanted // cost.expert_bytes
            shown.append(f"{text} = {slots} slots of {format_bytes(cost.expert_bytes)} "
                         f"({format_bytes(slots * cost.expert_bytes)})")
            if slots < trace.num_experts:
                raise ValueError(f"cache size {text} holds {slots} experts of "
                                 f"{format_bytes(cost.expert_bytes)}, fewer than one layer's "
                                 f"{trace.num_experts}")
            sizes.append(slots)
    sizes = sorted(set(sizes))
    too_small = [s for s in sizes if s < trace.num_experts]
    if too_small:
        raise ValueError(f"cache size {too_small[0]} cannot hold one layer of "
                         f"{trace.num_experts} experts")
    return sizes, shown


def _policies(requested, cost):
    """The policy list with ``fraction:auto`` resolved (docs/semantics.md §11.4)."""
    if requested is None:
        requested = DEFAULT_TIMED_POLICIES if cost.link_bandwidth and cost.cpu_bandwidth \
            else DEFAULT_POLICIES
    resolved = [cost.auto_policy() if p == "fraction:auto" else p for p in requested]
    return list(dict.fromkeys(resolved))


def _clamped(policy: str) -> str:
    """``fraction:Q`` as the fraction it runs when clamping or rounding changes it
    (``fraction:1.5`` -> ``fraction:1``, ``fraction:-1`` -> ``fraction:0``; see
    :func:`_policy_warnings`), so a row shows what it ran; anything else unchanged."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.sweep import parse_policy

    kind, _, value = policy.partition(":")
    if kind != "fraction":
        return policy
    try:
        requested, f16 = float(value), int(parse_policy(policy).fraction16)
    except ValueError:
        return policy  # malformed: config_grid reports it
    if f16 == 0 and requested != 0:
        return "fraction:0"
    if f16 == ONE and requested > 1:
        return "fraction:1"
    return policy


def _knn_companions(configs, args) -> list:
    """When the sweep is LRU alone and printed as a table: route_knn at each size of one LRU
    series (policy ``full`` if swept, else the first policy; the first order; the first
    admission route_knn takes), replayed for the legend's one line only (the rows stay LRU's)."""
    from pallas_cache.sizing.sweep import ReplayConfig

    fmt = args.format or ("json" if args.json else "table")
    admissions = [a for a in args.admission if a != "reuse"]
    if fmt != "table" or set(args.eviction) != {"lru"} or not configs or not admissions:
        return []
    policies = [c.policy for c in configs]
    policy = "full" if "full" in policies else policies[0]
    sizes = dict.fromkeys(c.cache_size for c in configs)
    return [ReplayConfig(size, policy, args.order[0], admissions[0], "route_knn")
            for size in sizes]


def _companion_hit_rates(trace, companions, cancelled=lambda: False) -> list[float]:
    """The hit rate of each companion configuration (one policy, order and admission, any sizes)
    on ``trace``: the replay's rule (1 - missing / active over every accepted call) from a plain
    scan of the library's step per size, all sizes through one compiled program (states at the
    largest capacity, each with its usable size). Cheaper to compile than the replay's chunk
    program (not unrolled, no pair counts, no lanes), which is all this one line needs. Runs in
    chunks of calls (the last padded with refused calls, which change nothing) and returns
    ``[]`` once ``cancelled()`` says so."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_cache.ops import Rules, ensure_with_rules
    from pallas_cache.sizing.sweep import parse_policy
    from pallas_cache.state import init

    first = companions[0]
    sizes = [c.cache_size for c in companions]
    policy = parse_policy(first.policy)
    rules = Rules.of(hybrid=True, order=first.order, admission=first.admission)

    @jax.jit
    def advance(state, layers, routes):
        def call(state, layer_routes):
            state, _ = ensure_with_rules(state, layer_routes[0], layer_routes[1], policy, rules,
                                         backend="xla")
            return state, None
        return jax.lax.scan(call, state, (layers, routes))[0]

    layers, routes = trace.to_array()
    chunk = min(_COMPANION_CHUNK, len(layers))
    pad = -len(layers) % chunk
    layers = np.concatenate([layers, np.full(pad, -1, layers.dtype)])  # layer -1: refused
    routes = np.concatenate([routes, np.full((pad, routes.shape[1]), -1, routes.dtype)])
    rates = []
    for size in sizes:
        state = init(trace.num_layers, trace.num_experts, size, capacity=max(sizes),
                     eviction=first.eviction)
        for start in range(0, len(layers), chunk):
            if cancelled():
                return []
            state = advance(state, jnp.asarray(layers[start:start + chunk]),
                            jnp.asarray(routes[start:start + chunk]))
        _, active, missing, _ = (int(v) for v in jax.device_get(state.stats.sum(axis=0)))
        rates.append(1.0 - missing / active if active else 1.0)
    return rates


def _join_companions(thread, stop) -> None:
    """Wait for the route_knn thread; interrupted, tell it to stop and still wait (a process
    that exits while XLA runs in a thread aborts instead of exiting 130)."""
    try:
        thread.join()
    except BaseException:
        stop.set()
        thread.join()
        raise


def _knn_line(results, companions, hit_rates) -> str | None:
    """The legend's line: route_knn's hit rate minus LRU's, at each size of the companions'
    series (``None`` without companions)."""
    if not companions or len(hit_rates) != len(companions):
        return None
    first = companions[0]
    lru = {r.cache_size: r.hit_rate for r in results
           if (r.policy, r.order, r.admission, r.eviction)
           == (first.policy, first.order, first.admission, "lru")}
    changes = ", ".join(f"{rate - lru[knn.cache_size]:+.3f} at {knn.cache_size}"
                        for knn, rate in zip(companions, hit_rates) if knn.cache_size in lru)
    return (f"route_knn (the eviction that wins on real Mixtral routing) on this trace, policy "
            f"{first.policy}: hit rate {changes} (add --eviction lru route_knn to see its rows).")


def _legend(results, trace, cost, knn_line: str | None = None) -> list[str]:
    """What a newcomer needs to read the table: the bounds, the model, the verdict, and (an LRU
    sweep) what route_knn changes (one line, not wrapped)."""
    k = min(trace.top_k, trace.num_experts)
    paragraphs = [
        "hit_rate = 1 - missing/active per layer-call. Bounds: belady_hit_rate bounds the `full` "
        "rows (every miss admitted); bypass_optimum_hit_rate bounds every row (a miss may be "
        "served without being admitted); oracle_hit_rate (a fixed max(1, round(S/L)) slots per "
        f"layer) is a reference, not a bound. L*k = {trace.num_layers * k} slots hold one "
        "token's experts.",
    ]
    if not cost.expert_bytes:
        paragraphs.append("For bytes and ms per token add --model NAME (or --expert-bytes 336MiB) "
                          "and --link-bandwidth 25GB/s --cpu-bandwidth 60GB/s (your machine's "
                          "numbers: see the README).")
    elif not cost.timed:
        paragraphs.append("For modeled ms per token add --link-bandwidth and --cpu-bandwidth.")
    else:
        paragraphs.append("modeled_ms_per_token: per layer-call max(fetched*W/B_link, "
                          "cpu_experts*W/B_cpu), summed per token (docs/semantics.md §11); "
                          "best = the fastest row at its cache_size.")
        if cost.device_budget is None:
            paragraphs.append("No --device-budget: in this model a bigger cache is never slower, "
                              "so only a budget picks one (e.g. --device-budget 24GiB).")
        else:
            chosen = [r for r in results if r.budget_best]
            budget = format_bytes(cost.device_budget)
            if not chosen:
                smallest = min(r.cache_bytes for r in results)
                paragraphs.append(f"No configuration fits the {budget} device budget (the "
                                  f"smallest pool takes {format_bytes(smallest)}).")
            for r in chosen:
                paragraphs.append(
                    f"Best within {budget}: cache_size={r.cache_size} "
                    f"({format_bytes(r.cache_bytes)}) policy={r.policy} order={r.order} "
                    f"admission={r.admission}"
                    f"{'' if r.eviction == 'lru' else ' eviction=' + r.eviction}: "
                    f"{r.modeled_ms_per_token:.1f} ms/token modeled.")
    return ([textwrap.fill(text, width=100, break_on_hyphens=False) for text in paragraphs]
            + ([knn_line] if knn_line else []))


def _write_atomically(path: str, write) -> None:
    """``write(temp_path)`` next to ``path``, then rename over it: an interrupt or error leaves
    no partial file behind."""
    folder, name = os.path.split(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(dir=folder, prefix=f".{name}.",
                                    suffix=os.path.splitext(name)[1])
    os.close(handle)
    try:
        write(temp)
        try:  # the temporary file is 0600: give it the mode the file has, or a new file gets
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = _new_file_mode()
        os.chmod(temp, mode)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def _plot(rows, path: str) -> None:
    from pallas_cache.sizing.plotting import plot

    figure = plot(rows)
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    _write_atomically(path, lambda temp: figure.savefig(temp, dpi=120, format=extension))


class _InterruptLatch:
    """Ctrl-C that is never lost. Python raises ``KeyboardInterrupt`` at the next bytecode of the
    main thread, which may run inside a callback of XLA's compiler that swallows it (a SIGINT
    during the first compile once let the replay finish and write its plot). The latch also
    records the signal, and :meth:`check` raises again wherever the CLI looks (every progress
    report, and before any output is written). Installed only over Python's default handler, in
    the main thread."""

    def __init__(self):
        self.fired = False
        self._previous = None

    def __enter__(self):
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False

    def _handle(self, signum, frame):
        self.fired = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.fired:
            raise KeyboardInterrupt


class _Checked(Progress):
    """A :class:`Progress` that checks the interrupt latch at every report."""

    def __init__(self, inner: Progress, latch: _InterruptLatch):
        self.inner, self.latch = inner, latch

    def phase(self, line, total):
        self.latch.check()
        self.inner.phase(line, total)

    def update(self, done, status=""):
        self.latch.check()
        self.inner.update(done, status)

    def note(self, line):
        self.latch.check()
        self.inner.note(line)

    def close(self):
        self.inner.close()


def _precompile_synthetic(args, policies, cost) -> threading.Thread | None:
    """A thread compiling the replay's programs while the synthetic trace is generated (its
    geometry is the preset's, so the sweep is known before the trace), or ``None`` where the
    sweep's options are off (the replay reports them after the trace, as for a trace file)."""
    from pallas_cache.sizing.sweep import config_grid, precompile

    try:  # a refused trace starts no compile: the thread never outlives a refusal
        params, _ = synthetic.checked_params(args.synthetic or DEFAULT_PRESET, args.tokens,
                                             args.seed, max_memory=args.max_memory)
        sizes, _ = _sizes(args.cache_size, params, cost)
        configs = config_grid(sizes, policies, args.order, args.admission, args.eviction)
        _check_state_memory(sizes, len(configs) // len(set(sizes)), params.num_layers,
                            params.num_experts, args.max_memory)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not configs:
        return None

    finished = threading.Event()
    _COMPILES.append(finished)

    def compile_quietly():
        try:
            precompile(params.num_layers, params.num_experts, params.top_k, configs)
        except Exception:  # noqa: BLE001 - the replay compiles, and reports, on its own
            pass
        finally:
            finished.set()

    thread = threading.Thread(target=compile_quietly, daemon=True,
                              name="pallas-cache-precompile")
    thread.start()
    return thread


#: One event per precompile thread, set by the thread as it ends. (``Thread.is_alive()`` is no
#: witness: a ``join()`` interrupted by Ctrl-C can leave it False while the thread compiles.)
_COMPILES: list[threading.Event] = []


def _exit_now_if_compiling(status: int) -> None:
    """End the process with ``status`` at once if a precompile thread is still running.

    The interpreter's normal exit stops daemon threads wherever they are; one inside XLA's C++
    code then aborts the process (``terminate called ...``, exit 134) after the CLI has printed
    its line. A refusal starts no such thread, but a Ctrl-C can arrive while one compiles, so
    the console script flushes its output and leaves without the interpreter's teardown."""
    if all(finished.is_set() for finished in _COMPILES):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _replay(args) -> int:
    with _InterruptLatch() as latch:
        progress = _Checked(Progress() if args.quiet else
                            Bar(sys.stderr, prefix="pallas-cache: "), latch)
        try:
            return _replay_with(args, progress, latch)
        finally:  # after an error or Ctrl-C too: the last line starts on a line of its own
            progress.close()


def _replay_with(args, progress: Progress, latch: _InterruptLatch) -> int:
    from pallas_cache.sizing.sweep import config_grid, replay  # jax import deferred until needed

    try:
        if args.max_memory is None:
            args.max_memory = default_memory_limit()
        if args.field is not None:
            if not args.trace:
                raise ValueError("--field names the keys of a JSONL or Parquet --trace")
            parse_fields(args.field)
        if args.plot:
            args.plot = _check_plot_path(args.plot)
        cost, model, weight_label = _cost_options(args)
        requested = _policies(args.policy, cost)
        policies = list(dict.fromkeys(_clamped(policy) for policy in requested))
        progress.note(f"reading {args.trace}..." if args.trace else
                      f"generating the {args.synthetic or DEFAULT_PRESET} trace...")
        compiling = None if args.trace else _precompile_synthetic(args, policies, cost)
        trace = _load(args, progress)
        sizes, size_lines = _sizes(args.cache_size, trace, cost)
        configs = config_grid(sizes, policies, args.order, args.admission, args.eviction)
        if not configs:
            raise ValueError(f"admission reuse needs eviction lru; got --eviction "
                             f"{' '.join(args.eviction)}")
    except (TraceError, OSError, KeyError, TypeError, ValueError) as error:
        progress.close()
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    try:
        _check_state_memory(sizes, len(configs) // len(set(sizes)), trace.num_layers,
                            trace.num_experts, args.max_memory)
    except (TypeError, ValueError) as error:
        progress.close()
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    progress.close()  # the note: warnings follow on a clean line
    for line in _policy_warnings(requested):
        print(line, file=sys.stderr)
    if model is not None and _model_mismatch(model, trace):
        print(_model_mismatch(model, trace), file=sys.stderr)
    if compiling is not None:
        compiling.join()  # a replay started before its program is compiled compiles it again
    # route_knn's hit rates for the legend, computed beside the sweep (a thread: XLA runs without
    # the GIL) and apart from it, so no LRU row (nor its budget pick) depends on them.
    companions = _knn_companions(configs, args)
    knn_rates: list = []
    knn_thread, knn_stop = None, threading.Event()
    if companions:
        knn_thread = threading.Thread(
            target=lambda: knn_rates.extend(
                _companion_hit_rates(trace, companions, knn_stop.is_set)),
            daemon=True, name="pallas-cache-route-knn")
        knn_thread.start()
    try:
        results = replay(trace, configs, cost=cost, progress=progress)
    except BaseException:
        knn_stop.set()
        if knn_thread is not None:
            _join_companions(knn_thread, knn_stop)
        raise
    if knn_thread is not None:
        _join_companions(knn_thread, knn_stop)
    latch.check()  # nothing is written after a Ctrl-C, even one a compile callback swallowed
    fmt = args.format or ("json" if args.json else "table")
    rows = records(results, trace, cost)
    if fmt != "table":
        print(format_records(rows, fmt))
    else:
        header = []
        if weight_label:
            header.append(f"expert: {weight_label}")
        if cost.link_bandwidth or cost.cpu_bandwidth:
            header.append("bandwidth: " + "  ".join(
                f"{name}={format_bandwidth(value)}" for name, value in
                (("B_link", cost.link_bandwidth), ("B_cpu", cost.cpu_bandwidth)) if value))
        if args.policy is None or "fraction:auto" in args.policy:
            if cost.link_bandwidth and cost.cpu_bandwidth:
                header.append(f"fraction:auto = B_link/(B_link+B_cpu) = "
                              f"{cost.auto_fraction():.4f} -> {cost.auto_policy()}")
        header += [f"size: {line}" for line in size_lines]
        print(format_records(rows, "table", header))
        print("\n".join(_legend(results, trace, cost, _knn_line(results, companions, knn_rates))))
    if args.plot:
        try:
            _plot(rows, args.plot)
        except OSError as error:  # checked before the replay; changed since
            print(f"pallas-cache: --plot {args.plot}: {error.strerror or error}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _scenarios(_args) -> int:
    from pallas_cache.sizing.scenarios import promotion_table

    rows = promotion_table()
    width = max(len(name) for name, _, _ in rows)
    print("Promotion scenarios: fraction 0.4, L=8, E=16, S=64, top-8, 256 steps per active layer")
    print(f"{'scenario'.ljust(width)}  {'NONE':>6}  {'PROMOTE_ONE':>11}")
    for name, none, promote in rows:
        print(f"{name.ljust(width)}  {none:>6}  {promote:>11}")
    return 0


def _bench_bandwidth(args) -> int:
    if min(args.mib, args.d_model, args.d_expert, args.repeats) < 1:
        print("pallas-cache: --mib, --d-model, --d-expert and --repeats must be >= 1",
              file=sys.stderr)
        return 2
    import jax

    from pallas_cache.sizing.bandwidth import cpu_bandwidth, link_bandwidth

    device = jax.devices()[0]
    link = link_bandwidth(args.mib * 2**20, args.repeats, device)
    cpu = cpu_bandwidth(args.d_model, args.d_expert, args.repeats)
    print(f"device: {device.platform}:{device.id} ({device.device_kind})")
    where = "host -> device" if device.platform != "cpu" else "host -> host (no accelerator)"
    print(f"B_link ~ {format_bandwidth(link)}  ({where} copy of {args.mib}MiB, pageable memory, "
          f"median of {args.repeats})")
    print(f"B_cpu  ~ {format_bandwidth(cpu)}  (one-token float32 x @ W, W {args.d_model} x "
          f"{args.d_expert}, median of {args.repeats})")
    print(f"flags: --link-bandwidth {format_bandwidth(link)} --cpu-bandwidth {format_bandwidth(cpu)}")
    return 0


def compile_cache_dir() -> str:
    """Where the console script keeps compiled programs: ``$XDG_CACHE_HOME/pallas-cache/jax``,
    or ``~/.cache/pallas-cache/jax`` when ``XDG_CACHE_HOME`` is unset or not absolute."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallas-cache", "jax")


def _enable_compile_cache() -> None:
    """Turn on JAX's persistent compilation cache in :func:`compile_cache_dir`, for programs of
    any size and compile time (a replay's programs take seconds to compile, a reread takes
    milliseconds). A cache directory the user set for JAX (``JAX_COMPILATION_CACHE_DIR``) is
    left as it is; one that cannot be created means running without the cache."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = compile_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def main(argv=None) -> int:
    """Run ``pallas-cache``; returns the exit status (``130`` after Ctrl-C, with one line on
    stderr and no partial output file). Never touches JAX's persistent compilation cache (the
    console script, :func:`console_main`, does)."""
    return _main(argv, compile_cache=False)


def console_main() -> int:
    """The ``pallas-cache`` console script: :func:`main` with JAX's persistent compilation cache
    on (see :func:`compile_cache_dir`) unless ``--no-compile-cache`` is given or
    ``PALLAS_CACHE_NO_COMPILE_CACHE`` is set to anything but ``""`` or ``"0"``."""
    status = _main(None, compile_cache=True)
    _exit_now_if_compiling(status)
    return status


def _main(argv, *, compile_cache: bool) -> int:
    try:
        args = _parser().parse_args(argv)
        if (compile_cache and not args.no_compile_cache
                and os.environ.get(NO_COMPILE_CACHE_ENV, "") in ("", "0")):
            _enable_compile_cache()
        if args.command == "replay":
            return _replay(args)
        if args.command == "bench-bandwidth":
            return _bench_bandwidth(args)
        return _scenarios(args)
    except _UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pallas-cache: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(console_main())
