"""``pallas-cache replay``'s typed request: the parser's namespace becomes one frozen record of
library types, built after every check made before reading; the format registry drives the
trace files and ``--trace-format``."""

from __future__ import annotations

import dataclasses

import pytest

from pallas_cache import Admission, Eviction, FetchOrder
from pallas_cache.sizing.cli.parser import UsageError, build_parser
from pallas_cache.sizing.cli.request import (CacheSize, ReplayRequest, SyntheticSource,
                                             TraceFile, build_request)
from pallas_cache.sizing.sweep.cost import CostModel
from pallas_cache.sizing.traces import formats


def request(*argv) -> ReplayRequest:
    return build_request(build_parser().parse_args(["replay", *argv]))


def test_the_request_is_frozen_and_holds_library_types():
    """FAILS if the request is not a frozen record, keeps a parser string where a library type
    belongs (the axes, the cost model, the sizes, the source), or can be changed in place."""
    got = request("--synthetic", "mixtral-like", "--tokens", "8", "--cache-size", "64", "12GiB",
                  "auto", "--model", "mixtral-8x7b", "--order", "recency", "lowest_id",
                  "--eviction", "lru", "route_knn", "--link-bandwidth", "25GB/s")
    assert got.orders == (FetchOrder.RECENCY, FetchOrder.LOWEST_ID)
    assert got.admissions == (Admission.PROMOTE_ONE,)
    assert got.evictions == (Eviction.LRU, Eviction.ROUTE_KNN)
    assert isinstance(got.cost, CostModel) and got.cost.link_bandwidth == 25e9
    assert got.cache_sizes == (CacheSize("64", slots=64),
                               CacheSize("12GiB", slots=12 * 2**30 // (336 * 2**20),
                                         nbytes=12 * 2**30),
                               CacheSize("auto"))
    assert got.source == SyntheticSource("mixtral-like", 8, 0, {"num_layers": 32,
                                                               "num_experts": 8, "top_k": 2})
    assert got.output.format == "table" and got.batches is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.devices = 2  # type: ignore[misc]
    trace = request("--trace", "routes.jsonl", "--num-experts", "8", "--field", "layer=l")
    assert trace.source == TraceFile("routes.jsonl", "auto", {"layer": "l"}, None, 8)


@pytest.mark.parametrize("argv, line", [
    (["--cache-size", "0"], "pallas-cache: cache size 0 is outside [1, 2147483647] slots"),
    (["--devices", "2"], "pallas-cache: --devices and --parallel go together (e.g. --devices 2 "
                         "--parallel tensor)"),
    (["--trace", "x.jsonl", "--top-k", "2"], "pallas-cache: --top-k applies to a synthetic "
                                            "trace; a --trace's routes give its top-k"),
])
def test_a_refused_command_line_is_one_usage_error(argv, line):
    """FAILS if a refusal the flags alone decide escapes ``build_request`` as anything but one
    UsageError whose text is the whole line the CLI prints."""
    with pytest.raises(UsageError) as refused:
        request(*argv)
    assert str(refused.value) == line


def test_the_format_registry_is_what_reads_writes_and_offers(tmp_path):
    """FAILS if a trace format is not one record of the registry (name, suffixes, load, save)
    that load_trace, save_trace, the suffix rule and ``--trace-format`` all follow."""
    from pallas_cache.sizing.traces import Trace, load_trace, save_trace

    assert formats.TRACE_FORMATS == tuple(f.name for f in formats.FORMATS)
    trace = Trace.from_dense([[[0, 1], [2, 3]], [[1, 0], [3, 2]]], num_experts=4)
    for fmt in formats.FORMATS:
        for suffix in fmt.suffixes:
            if fmt.save is None or (fmt.name == "parquet" and not _has_pyarrow()):
                continue
            path = tmp_path / f"t{suffix}"
            save_trace(trace, path)
            assert formats.trace_format_of(path) == fmt.name
            back = load_trace(path, num_experts=4)
            assert (back.routes == trace.routes).all() and back.num_layers == 2
    replay = next(action for action in build_parser()._subparsers._group_actions
                  ).choices["replay"]
    [action] = [a for a in replay._actions if a.dest == "trace_format"]
    assert action.choices == ("auto",) + formats.TRACE_FORMATS
    for fmt in formats.FORMATS:
        assert f"{fmt.name} {fmt.about}".strip() in action.help


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def test_one_byte_grammar_says_where_8gb_is_bytes():
    """FAILS if the two byte parsers of units.py stop sharing their prefixes, or if ``8gb``
    changes meaning: bytes as a memory limit (``--max-memory``), refused in a size of the model
    (``--cache-size``, ``--expert-bytes``, ``--device-budget``: case-sensitive, ``b`` is bits)."""
    from pallas_cache.sizing.units import parse_bytes, parse_memory_size

    assert parse_memory_size("8gb") == parse_bytes("8GB") == 8 * 10**9
    assert parse_memory_size("8GiB") == parse_memory_size("8gib") == parse_bytes("8GiB")
    for text in ("8gb", "8Gb"):
        with pytest.raises(ValueError, match="bad byte size"):
            parse_bytes(text)
    for text in ("8gi", "8 bits", "0.5"):
        with pytest.raises(ValueError):
            parse_memory_size(text)


def test_the_bench_commands_parse_into_checked_frozen_requests():
    """FAILS if ``bench-bandwidth`` or ``bench-decode`` hands its argparse namespace to the
    work instead of one frozen request, built and checked in one place: the model and dtype
    resolved, the defaults left to the run (``None``), a bad flag refused by the builder."""
    from pallas_cache.sizing.cli.bench import BandwidthRequest, build_bandwidth_request
    from pallas_cache.sizing.cli.decode import DecodeRequest, build_decode_request

    def parsed(*argv):
        return build_parser().parse_args(list(argv))

    got = build_bandwidth_request(parsed("bench-bandwidth", "--model", "mixtral-8x7b:int8",
                                         "--mib", "8"))
    assert got == BandwidthRequest(mib=8, dtype="int8", d_model=4096, d_expert=None, repeats=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.mib = 1  # type: ignore[misc]
    with pytest.raises(UsageError, match="--mib, --d-model, --d-expert and --repeats"):
        build_bandwidth_request(parsed("bench-bandwidth", "--mib", "0"))
    decode = build_decode_request(parsed("bench-decode", "--small", "--cache-size", "8", "12",
                                         "--eviction", "lru"))
    assert isinstance(decode, DecodeRequest) and decode.dtype == "fp32"
    assert decode.model.name == "mixtral-8x7b" and decode.small
    assert decode.cache_sizes == ("8", "12") and decode.evictions == ("lru",)
    assert decode.policies is None and decode.layers is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        decode.small = False  # type: ignore[misc]
    with pytest.raises(UsageError, match="--layers must be >= 1, got 0"):
        build_decode_request(parsed("bench-decode", "--layers", "0"))
