"""``pallas-cache``'s command line: the argument parser with its help text, and the checks that
refuse a bad command line before any work (each as one line, exit 2)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tempfile

from pallas_cache import __version__
from pallas_cache.sizing import cli_names
from pallas_cache.sizing.cli_checks import use_ascii_ints
from pallas_cache.sizing.cli_sizing import add_sizing_arguments, cpu_fixed_seconds, gpu_seconds
from pallas_cache.sizing.cost import CostModel
from pallas_cache.sizing.models import MODELS, resolve_model
from pallas_cache.sizing.report import FORMATS, legend_text
from pallas_cache.sizing.units import format_bytes, parse_bandwidth, parse_bytes

__all__ = ["DEFAULT_PLOT_NAME", "DEFAULT_POLICIES", "DEFAULT_PRESET", "DEFAULT_TIMED_POLICIES",
           "NO_COMPILE_CACHE_ENV", "Parser", "REPLAY_HELP", "UsageError", "build_parser",
           "cache_sizes", "check_plot_path", "check_state_memory", "clamped", "cost_options",
           "memory_size", "model_mismatch", "policy_warnings", "resolve_policies"]

DEFAULT_PRESET = "mixtral-realistic"
DEFAULT_POLICIES = ("full", "fraction:0.4")
#: The default policies once both bandwidths are known: the balanced split joins them.
DEFAULT_TIMED_POLICIES = ("full", "fraction:auto", "fraction:0.4")
#: File written inside a directory given to ``--plot``.
DEFAULT_PLOT_NAME = "hit_rate.png"
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
Models: """ + ", ".join(MODELS) + """
(NAME:DTYPE for bf16, fp16, fp32, fp8, int8, int4, fp8-b128, mxfp4; default: the released
format, docs/semantics.md §11.1). A synthetic trace takes L, E and top-k from --model, or from
--num-layers, --num-experts and --top-k.

Columns (the keys of every record; json, jsonl and csv carry all of them, table and markdown
the informative ones; an absent value is null in json, empty in csv, - in a table):
""" + legend_text(96) + "\n"


class UsageError(Exception):
    """A command line argparse refuses, as the one line the CLI prints."""


class Parser(argparse.ArgumentParser):
    """argparse, with a refused command line as one line (no usage block) and exit 2."""

    def error(self, message):
        raise UsageError(f"pallas-cache: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pallas-cache",
        description="Plan and size the GPU expert slot cache of offloaded MoE inference.",
    )
    parser.add_argument("--version", action="version", version=f"pallas-cache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = Parser(add_help=False)
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
    source.add_argument("--synthetic", metavar="PRESET", choices=cli_names.PRESETS,
                        help=f"a generated trace: {', '.join(cli_names.PRESETS)} "
                             f"(default: {DEFAULT_PRESET})")
    replay.add_argument("--tokens", type=int, default=None,
                        help="tokens to generate for --synthetic (default: the preset's)")
    replay.add_argument("--seed", type=int, default=0, help="seed for --synthetic (default: 0)")
    replay.add_argument("--trace-format", choices=("auto",) + cli_names.TRACE_FORMATS,
                        default="auto",
                        help="how to read --trace: auto (a directory is vllm, else the suffix "
                             "decides), jsonl, array (.npy/.npz [tokens, layers, top_k]), vllm "
                             "(the array layout, one request per file or .npz array, every "
                             "request the same layers and top_k) or parquet (default: auto)")
    replay.add_argument("--field", metavar="KEY=NAME[,...]", default=None,
                        help="the names a JSONL or Parquet --trace uses for the record keys "
                             f"({', '.join(cli_names.FIELD_KEYS)}), e.g. "
                             f"layer=layer_idx,experts=topk_ids")
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
                             f"(dtype default: the released format); with --synthetic, also "
                             f"its layers, experts and top-k")
    weight.add_argument("--expert-bytes", metavar="SIZE",
                        help="bytes of one routed expert, e.g. 336MiB")
    replay.add_argument("--link-bandwidth", metavar="RATE",
                        help="host-to-device copy bandwidth B_link, e.g. 25GB/s")
    replay.add_argument("--cpu-bandwidth", metavar="RATE",
                        help="expert bytes per second the CPU MoE path processes, B_cpu, "
                             "e.g. 60GB/s")
    replay.add_argument("--device-budget", metavar="SIZE",
                        help="device memory for the expert pool alone, e.g. 24GiB: names the "
                             "fastest configuration whose cache_bytes fits (needs W and both "
                             "bandwidths). Subtract the rest first: dense and attention weights, "
                             "the KV cache, activations, your engine's reserve")
    replay.add_argument("--devices", type=int, default=None, metavar="D",
                        help="size the caches of D devices (with --parallel); cache sizes and "
                             "--device-budget are per device")
    replay.add_argument("--parallel", choices=("expert", "tensor"), default=None,
                        help="with --devices: expert (each device its own experts and cache) or "
                             "tensor (each device 1/D of every expert, one cache)")
    replay.add_argument("--order", nargs="+", default=["recency"], choices=cli_names.ORDERS,
                        help="which misses win a capped fetch (default: recency)")
    replay.add_argument("--admission", nargs="+", default=["promote_one"],
                        choices=cli_names.ADMISSIONS,
                        help="fetches beyond the split (default: promote_one)")
    replay.add_argument("--eviction", nargs="+", default=["lru"],
                        choices=cli_names.EVICTIONS,
                        help="which resident a fetch evicts (default: lru); reuse is swept "
                             "with lru only. route_knn is what wins on real Mixtral routing "
                             "with --policy full: the best hit rate at every size on "
                             "Mixtral-8x7B HumanEval and GSM8K decode traces (21-51%% of the "
                             "LRU->Belady gap; with a hybrid split LRU can win, e.g. at "
                             "fraction:0.4 and 181 slots); its step "
                             "costs about 3x LRU's per call at Mixtral's geometry and about 6x at "
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
    replay.add_argument("--max-memory", type=memory_size, default=None, metavar="BYTES",
                        help="refuse a trace, synthetic size or cache state estimated above this "
                             "(e.g. 8GiB, 512MiB, 2e9; default: half the machine's memory)")
    replay.add_argument("-q", "--quiet", action="store_true",
                        help="no progress on stderr (warnings and errors still go there)")
    add_sizing_arguments(replay)

    commands.add_parser("scenarios", help="print the promotion scenarios' table", parents=[common])

    bench = commands.add_parser(
        "bench-bandwidth", help="measure B_link, B_cpu and T_cpu roughly, for replay's cost model",
        description="Measure the host-to-device copy bandwidth (B_link: jax.device_put of pageable "
                    "host memory), and the library's CPU path, cpu_partial, with 1-4 CPU experts "
                    "of one token (B_cpu: expert bytes per second, from the slope of a line "
                    "through its times; T_cpu: the line's intercept, a fixed cost per "
                    "layer-call), and print them as replay flags. A line on stderr per phase; "
                    "seconds, not minutes. Peak memory: about twice the CPU bank (4 experts of "
                    "d-model x d-expert float32: 448MiB by default) plus 0.75GiB; the default "
                    "bank halves its columns until that fits half the available memory. Rough: "
                    "a serving engine's pinned buffers and CPU kernels differ.",
        parents=[common])
    bench.add_argument("--mib", type=int, default=256,
                       help="MiB copied per B_link measurement (default: 256)")
    bench.add_argument("--d-model", type=int, default=4096,
                       help="expert matrix rows (default: 4096, Mixtral-8x7B's)")
    bench.add_argument("--d-expert", type=int, default=None,
                       help="expert matrix columns (default: 7168, half of Mixtral-8x7B's 14336: "
                            "112MiB per expert, past any CPU cache; fewer where memory is short)")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs, median (default: 5)")
    return use_ascii_ints(parser)


# ---- argument checks: everything that can fail does so before the work ----------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def memory_size(text: str) -> int:
    """``--max-memory``: ``8GiB``, ``512MiB``, ``2e9``, ``1000000`` -> bytes (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (e.g. 8GiB, 512MiB, "
                                         f"2e9)")
    number = float(match.group(1)) * _UNITS[unit]
    if not number < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is above the largest memory size, 2**63 - 1 "
                                         f"bytes")
    value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive memory size")
    return value


def check_plot_path(path: str) -> str:
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



def policy_warnings(policies) -> list[str]:
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


def check_state_memory(sizes, configs_per_size: int, num_layers: int, num_experts: int,
                        limit: int) -> int:
    """Refuse cache sizes whose replay state would exceed ``limit``, before any is allocated;
    returns the largest bucket's bytes (what the replay step's check adds to its own).

    A bucket of sizes replays its ``n`` configurations (``configs_per_size`` per size) as one
    batch of states at the bucket's largest size (``sweep.capacity_buckets``): the stacked
    states, the program's output batch and the initial state, ``2 * n + 1`` states in all.
    """
    from pallas_cache.sizing.sweep import capacity_buckets  # after config_grid's jax import
    from pallas_cache.sizing.traces import check_memory

    largest = 0
    for bucket in reversed(capacity_buckets(sizes)):
        size, count = bucket[-1], configs_per_size * len(bucket)
        state = (num_layers * num_experts * _STATE_BYTES_PER_ID + size * _STATE_BYTES_PER_SLOT
                 + num_layers * 16)
        check_memory((2 * count + 1) * state, limit, f"--cache-size {size}",
                     f"{count} cache state(s) of {size} slots for {num_layers} "
                     f"layers x {num_experts} experts")
        largest = max(largest, (2 * count + 1) * state)
    return largest


def cost_options(args):
    """``(CostModel, model label or None)`` from the flags; ValueError names the bad one."""
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
    cost = CostModel(width, link, cpu, budget, cpu_fixed_seconds(args, cost.timed))
    layer_seconds, expert_seconds = gpu_seconds(args, cost)
    if layer_seconds is not None or expert_seconds is not None:
        cost = dataclasses.replace(cost, gpu_layer_seconds=layer_seconds,
                                   gpu_expert_seconds=expert_seconds)
    if budget is not None and not cost.timed:
        raise ValueError("--device-budget needs an expert size (--model or --expert-bytes) and "
                         "both --link-bandwidth and --cpu-bandwidth")
    return cost, model, label


def model_mismatch(model, trace) -> str | None:
    """A warning when the trace's geometry is not the model's, else ``None``."""
    ours = (trace.num_layers, trace.num_experts, trace.top_k)
    theirs = (model.moe_layers, model.routed_experts, model.top_k)
    if ours == theirs:
        return None
    return (f"pallas-cache: warning: the trace has {ours[0]} layers x {ours[1]} experts, "
            f"top-{ours[2]}, but {model.name} has {theirs[0]} MoE layers x {theirs[1]} routed "
            f"experts, top-{theirs[2]}: W comes from the model, the routing from the trace")


def cache_sizes(texts, trace, cost):
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


def resolve_policies(requested, cost, top_k=None):
    """The policy list with ``fraction:auto`` resolved (docs/semantics.md §11.4; with a fixed
    CPU cost it depends on ``top_k``, the routes per call)."""
    if requested is None:
        requested = DEFAULT_TIMED_POLICIES if cost.link_bandwidth and cost.cpu_bandwidth \
            else DEFAULT_POLICIES
    resolved = [cost.auto_policy(top_k) if p == "fraction:auto" else p for p in requested]
    return list(dict.fromkeys(resolved))


def clamped(policy: str) -> str:
    """``fraction:Q`` as the fraction it runs when clamping or rounding changes it
    (``fraction:1.5`` -> ``fraction:1``, ``fraction:-1`` -> ``fraction:0``; see
    :func:`policy_warnings`), so a row shows what it ran; anything else unchanged."""
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
