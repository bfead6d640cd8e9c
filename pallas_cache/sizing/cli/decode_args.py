"""``pallas-cache bench-decode``'s arguments and defaults (no JAX, no NumPy: ``--help``
answers at once); :mod:`~pallas_cache.sizing.cli.decode` runs the command."""

from __future__ import annotations

import argparse

from pallas_cache.formats import FORMATS
from pallas_cache.sizing.cli import names as cli_names
from pallas_cache.sizing.models import MODELS

__all__ = ["DEFAULT_MODEL", "DEFAULT_TOKENS", "HOST_SHARE", "SMALL", "add_parser"]

DEFAULT_MODEL = "mixtral-8x7b"
#: ``--small``: a Mixtral-shaped expert (E = 8, top-2) of 512 x 1024, float32 (XLA:CPU's bf16
#: matmuls ran 9x slower than float32 ones), 4 layers, 32 tokens: minutes on a small CPU-only
#: machine, most of them compiling.
SMALL = dict(d_model=512, d_expert=1024, dtype="fp32", layers=4, tokens=32)
DEFAULT_TOKENS = 32
#: The default host budget: this share of the memory available now.
HOST_SHARE = 0.5

HELP = """
Decode a routing trace one token at a time with random expert weights at a model's expert
geometry, the bank in host memory, and time it for each row a user compares: every expert
resident (the floor, where it fits), no cache (each layer-call copies its routed experts), and
cache configurations (default: full copies with lru and route_knn, and the split replay's cost
model recommends for the measured bandwidths, with lru). Each row's per-call counts are checked
equal to the replay's on the same routes, and each row is printed beside the replay's timed
model (overlap_ms_per_token) with its parameters measured in the same run: the copy path's
bytes per second, the CPU partial's at the bank's dtype, a layer-call's time outside its
experts (A) and per device expert (C).

Left out: attention, dense layers and the LM head (each layer is its MoE block alone); the
router is the trace's.

  pallas-cache bench-decode --small                    # minutes on a CPU-only machine
  pallas-cache bench-decode --model mixtral-8x7b --layers 16 --cache-size 32 48
  pallas-cache bench-decode --model qwen3-30b-a3b --trace routes.jsonl --tokens 64 --format json
"""


def add_parser(commands, common, memory_size, default_preset: str) -> argparse.ArgumentParser:
    """Add ``bench-decode`` to the ``pallas-cache`` subcommands (``memory_size``: the parser's
    byte-size type; ``default_preset``: its synthetic preset; passed in, so this module imports
    nothing of the parser)."""
    parser = commands.add_parser(
        "bench-decode", help="decode at a model's expert size and compare with the replay's model",
        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common])
    parser.add_argument("--model", metavar="NAME[:DTYPE]", default=None,
                        help=f"the expert geometry and dtype: {', '.join(MODELS)} (default: "
                             f"{DEFAULT_MODEL}; --small: float32); the library's expert "
                             f"functions read {', '.join(FORMATS)}")
    parser.add_argument("--small", action="store_true",
                        help=f"a small geometry: d_model {SMALL['d_model']}, d_expert "
                             f"{SMALL['d_expert']}, {SMALL['dtype']}, {SMALL['layers']} layers, "
                             f"{SMALL['tokens']} tokens (the model's E and top-k)")
    parser.add_argument("--d-model", type=int, default=None, help="override the model's d_model")
    parser.add_argument("--d-expert", type=int, default=None,
                        help="override the model's d_expert")
    parser.add_argument("--layers", type=int, default=None,
                        help="MoE layers to decode (default: as many as --host-memory fits, up "
                             "to the model's and the trace's)")
    parser.add_argument("--host-memory", type=memory_size, default=None, metavar="BYTES",
                        help=f"host memory for the bank (and, on a CPU, the pools), e.g. 64GiB "
                             f"(default: {HOST_SHARE:g} of the memory available now)")
    parser.add_argument("--cache-size", nargs="+", metavar="SIZE", default=None,
                        help="pool sizes, slots or bytes such as 12GiB (default: L*k and "
                             "1.5*L*k slots)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="PATH", help="a routing trace: its first layers")
    source.add_argument("--synthetic", metavar="PRESET", choices=cli_names.PRESETS,
                        help=f"a generated trace at the model's E and top-k: "
                             f"{', '.join(cli_names.PRESETS)} (default: {default_preset})")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens to decode (default: {DEFAULT_TOKENS})")
    parser.add_argument("--seed", type=int, default=0, help="weights, gates, synthetic trace")
    parser.add_argument("--policy", nargs="+", default=None, metavar="P",
                        help="full | fraction:Q | fraction:auto | cap:N; with --eviction, every "
                             "pair (default: full with lru and route_knn, fraction:auto with lru)")
    parser.add_argument("--eviction", nargs="+", default=None, choices=cli_names.EVICTIONS)
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="leave out the every-expert-resident row")
    parser.add_argument("--no-cache-row", dest="no_cache", action="store_false",
                        help="leave out the no-cache row")
    parser.add_argument("--bank-memory", choices=("auto", "pinned_host"), default="auto",
                        help="pinned_host: require the bank in a GPU's pinned host memory "
                             "(refused without a GPU); auto: pinned host memory where the "
                             "backend has it")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed decodes per row after a warm-up, median (default: 3)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed calls per parameter measurement, median (default: 5)")
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="seconds a parameter's slope may take more batches on a loaded "
                             "machine (default: 120)")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="table (default) or json: a list of rows")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return parser
