"""``pallas-cache``'s command line: the argument parser with its help text. A command line it
refuses is one :class:`UsageError` (one line, exit 2: :mod:`~pallas_cache.sizing.cli.entry`
prints it); what it accepts, :func:`~pallas_cache.sizing.cli.request.build_request` turns into a
typed request. No JAX, no NumPy: ``--help`` and ``--version`` answer at once."""

from __future__ import annotations

import argparse
import re

from pallas_cache import __version__
from pallas_cache.sizing.cli import names as cli_names
from pallas_cache.sizing.cli.decode_args import add_parser as add_bench_decode
from pallas_cache.sizing.cli.process import NO_COMPILE_CACHE_ENV
from pallas_cache.sizing.models import MODELS
from pallas_cache.sizing.report import FORMATS, legend_text
from pallas_cache.sizing.traces.formats import FORMATS as TRACE_FILE_FORMATS
from pallas_cache.sizing.traces.formats import TRACE_FORMATS
from pallas_cache.sizing.units import parse_memory_size

__all__ = ["DEFAULT_PLOT_NAME", "DEFAULT_POLICIES", "DEFAULT_PRESET", "DEFAULT_TIMED_POLICIES",
           "Parser", "REPLAY_HELP", "UsageError", "ascii_int", "build_parser", "memory_size"]

DEFAULT_PRESET = "mixtral-realistic"
DEFAULT_POLICIES = ("full", "fraction:0.4")
#: The default policies once both bandwidths are known: the balanced split joins them.
DEFAULT_TIMED_POLICIES = ("full", "fraction:auto", "fraction:0.4")
#: File written inside a directory given to ``--plot``.
DEFAULT_PLOT_NAME = "hit_rate.png"

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
    """A refused command line: its text is the one line the CLI prints (exit 2)."""


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
    replay.add_argument("--trace-format", choices=("auto",) + TRACE_FORMATS, default="auto",
                        help=_trace_format_help())
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
    _add_sizing_arguments(replay)

    commands.add_parser("scenarios", help="print the promotion scenarios' table", parents=[common])

    bench = commands.add_parser(
        "bench-bandwidth", help="measure B_link, B_cpu and T_cpu roughly, for replay's cost model",
        description="Measure the host-to-device copy bandwidth (B_link: jax.device_put of pageable "
                    "host memory), and the library's CPU path, cpu_partial with its SwiGLU "
                    "experts (pallas_cache.experts) at the bank's dtype, with 1-4 CPU experts "
                    "of one token (B_cpu: expert bytes per second, from the slope of a line "
                    "through its times; T_cpu: the line's intercept, a fixed cost per "
                    "layer-call), and print them as replay flags. A line on stderr per phase; "
                    "seconds, not minutes. Peak memory: about twice the CPU bank (4 experts of "
                    "at least 96MiB each at the dtype by default) plus 0.75GiB; the default "
                    "bank halves its columns until that fits half the available memory. Rough: "
                    "a serving engine's pinned buffers and CPU kernels differ.",
        parents=[common])
    bench.add_argument("--mib", type=int, default=256,
                       help="MiB copied per B_link measurement (default: 256)")
    bench.add_argument("--model", metavar="NAME[:DTYPE]",
                       help=f"measure the experts of a model: {', '.join(MODELS)} (its d_model, "
                            f"and its dtype unless --dtype; default: the released format)")
    bench.add_argument("--dtype", metavar="DTYPE",
                       help="the bank's dtype B_cpu is measured at: fp32, bf16, int8 or int4 "
                            "(the model presets' spellings; fp8 and mxfp4 have no expert "
                            "function; default: --model's, else bf16)")
    bench.add_argument("--d-model", type=int, default=None,
                       help="expert rows' width (default: --model's, else 4096, Mixtral-8x7B's)")
    bench.add_argument("--d-expert", type=int, default=None,
                       help="expert hidden units (default: the fewest multiple of 128 whose "
                            "SwiGLU expert holds 96MiB at the dtype, past any CPU cache; fewer "
                            "where memory is short)")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs, median (default: 5)")
    add_bench_decode(commands, common, memory_size, DEFAULT_PRESET)
    return _use_ascii_ints(parser)


def _trace_format_help() -> str:
    """``--trace-format``'s help, from the format registry."""
    parts = ["auto (a directory is vllm, else the suffix decides)"] + [
        f"{trace_format.name} {trace_format.about}".strip() for trace_format in TRACE_FILE_FORMATS]
    return f"how to read --trace: {', '.join(parts[:-1])} or {parts[-1]} (default: auto)"


def _add_sizing_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the sizing flags to the ``replay`` subcommand's parser, as one argument group."""
    group = replay.add_argument_group("sizing")
    group.add_argument("--route-knn-legend", dest="knn_legend",
                       action=argparse.BooleanOptionalAction, default=False,
                       help="end an LRU-only table's legend with route_knn's hit rate change at "
                            "each size: route_knn replayed beside the sweep, in the same "
                            "compiled programs (one more program to compile; off by default)")
    group.add_argument("--per-layer", action="store_true",
                       help="also give each configuration's hit rate per layer "
                            "(pallas_cache.per_layer_stats of its final state): lines under a "
                            "table or markdown, a layer_hit_rates list in each json, jsonl or "
                            "csv record (only with this flag)")
    group.add_argument("--top-k", type=int, default=None, metavar="K",
                       help="routes per layer-call of a synthetic trace (with --num-layers and "
                            "--num-experts, its geometry; default: --model's, else the "
                            "preset's); a --trace's routes give its own")
    group.add_argument("--batch", type=int, nargs="+", default=None, metavar="B",
                       help="replay B requests decoding together (continuous batching: a "
                            "finished request's place goes to the next), each layer-call "
                            "carrying every active request's token; a sweep axis like "
                            "--cache-size (default: 1, one token per call)")
    group.add_argument("--requests", type=int, default=None, metavar="N",
                       help="cut a synthetic trace into N requests of unequal length (for "
                            "--batch; a --trace's sequences are its requests)")
    group.add_argument("--cpu-fixed-cost", metavar="TIME", default=None,
                       help="T_cpu, the CPU partial's fixed cost per layer-call that has at "
                            "least one CPU expert, e.g. 0.08ms (pallas-cache bench-bandwidth "
                            "measures it; needs W and both bandwidths; default 0)")
    group.add_argument("--gpu-layer-ms", metavar="A", default=None,
                       help="A, a layer-call's GPU time outside its routed experts (attention, "
                            "router, norms, the cache step), in ms (e.g. 0.07, an estimate: "
                            "docs/replay.md); with --gpu-expert-ms, times the decode with "
                            "copies and compute overlapping (overlap_ms_per_token, "
                            "stall_ms_per_token, prefetch_bound; docs/semantics.md §11.6); "
                            "needs W and --link-bandwidth")
    group.add_argument("--gpu-expert-ms", metavar="C", default=None,
                       help="C, the GPU time of one routed expert computed on the device, in "
                            "ms (e.g. 0.09); either flag turns the GPU-time model on, the "
                            "other then counting as 0")


_ASCII_INT = re.compile(r"[+-]?[0-9]+")


def ascii_int(text: str) -> int:
    """argparse type: an integer in ASCII digits (``int()`` also takes ``'٣'``, and ``'²'``
    fails with Python's own message)."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (ASCII digits)")
    return int(text)


def _use_ascii_ints(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (and its sub-commands) with every ``type=int`` option read by
    :func:`ascii_int`."""
    for action in parser._actions:  # noqa: SLF001 - argparse exposes no public walk
        if action.type is int:
            action.type = ascii_int
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                _use_ascii_ints(sub)
    return parser


def memory_size(text: str) -> int:
    """``--max-memory``: :func:`~pallas_cache.sizing.units.parse_memory_size` as an argparse
    type."""
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
