"""NumPy routing traces: ``.npy``/``.npz`` arrays ``[tokens, layers, top_k]`` and vLLM's routed
experts (one such array per request)."""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

from pallas_cache.sizing.traces.base import Trace
from pallas_cache.sizing.traces.dense import ArrayMember, assemble_dense, check_member
from pallas_cache.sizing.traces.errors import READ_ERRORS, TraceError
from pallas_cache.sizing.traces.geometry import optional_positive_int
from pallas_cache.sizing.traces.memory import format_bytes, resolve_memory_limit

__all__ = ["load_array_trace", "load_vllm_trace", "save_array_trace"]

_ZIP_MAGIC = b"PK"


def _read_npy_header(stream: Any, label: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    except READ_ERRORS as exc:
        raise TraceError(f"{label}: not a readable NumPy .npy/.npz file: {exc}") from None
    if dtype.hasobject:
        raise TraceError(f"{label}: not a readable NumPy .npy/.npz file: object (pickled) "
                         f"arrays are refused")
    if any(int(d) < 0 for d in shape):
        raise TraceError(f"{label}: not a readable NumPy .npy/.npz file: negative shape {shape}")
    return tuple(int(d) for d in shape), bool(fortran), dtype


def _read_npy_data(stream: Any, label: str, shape: tuple[int, ...], dtype: np.dtype,
                   fortran: bool) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    try:
        data = stream.read(nbytes)
    except READ_ERRORS as exc:
        raise TraceError(f"{label}: cannot read the array data: {exc}") from None
    if len(data) != nbytes:
        raise TraceError(f"{label}: the header claims shape {shape} ({format_bytes(nbytes)}) but "
                         f"only {len(data)} bytes of data follow (truncated or corrupt file)")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _npy_members(path_str: str, name: str = "routes", label: str | None = None) -> list[ArrayMember]:
    label = label or f"{path_str}: array {name!r}"
    try:
        with open(path_str, "rb") as handle:
            shape, fortran, dtype = _read_npy_header(handle, path_str)
            offset, size = handle.tell(), os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc

    def read() -> np.ndarray:
        try:
            with open(path_str, "rb") as handle:
                handle.seek(offset)
                return _read_npy_data(handle, label, shape, dtype, fortran)
        except OSError as exc:
            raise TraceError(f"{path_str}: cannot read trace file: {exc}") from None

    member = ArrayMember(name, label, shape, dtype, fortran, read)
    if member.nbytes > size - offset:
        raise TraceError(f"{label}: the header claims shape {shape} "
                         f"({format_bytes(member.nbytes)}) but the file holds only "
                         f"{size - offset} bytes of data (truncated or corrupt file)")
    return [member]


def _npz_members(path_str: str) -> list[ArrayMember]:
    try:
        with zipfile.ZipFile(path_str) as archive:
            infos = archive.infolist()
            headers = []
            for info in infos:
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                label = f"{path_str}: array {name!r}"
                with archive.open(info) as stream:
                    headers.append((info, name, label, *_read_npy_header(stream, label)))
    except TraceError:
        raise
    except READ_ERRORS as exc:
        raise TraceError(f"{path_str}: not a readable NumPy .npy/.npz file: {exc}") from None
    if not headers:
        raise TraceError(f"{path_str}: the .npz archive holds no arrays")

    def reader(info: zipfile.ZipInfo, label: str, shape, dtype, fortran):
        def read() -> np.ndarray:
            try:
                with zipfile.ZipFile(path_str) as archive, archive.open(info) as stream:
                    _read_npy_header(stream, label)
                    return _read_npy_data(stream, label, shape, dtype, fortran)
            except TraceError:
                raise
            except READ_ERRORS as exc:
                raise TraceError(f"{label}: cannot read the array data: {exc}") from None
        return read

    return [ArrayMember(name, label, shape, dtype, fortran, reader(info, label, shape, dtype, fortran))
            for info, name, label, shape, fortran, dtype in headers]


def load_array_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                     num_experts: int | None = None, max_memory: int | None = None) -> Trace:
    """Read a ``.npy``/``.npz`` trace: integer arrays ``[tokens, layers, top_k]``.

    A ``.npy`` holds one sequence. In an ``.npz`` *every* array is one sequence, named after the
    array, in archive order (an archive of one array gives one unnamed sequence, as a ``.npy``);
    arrays may differ in token count and ``top_k`` (narrower ones are ``-1`` padded), but not in
    layer count: the arrays of one file are one model's routing, as :func:`load_vllm_trace`
    requires. Every array must be an integer array of rank 3. Sizes come from the headers and
    are checked against the memory limit (and the file size) before any data is read. Pickled
    (object) arrays are refused.

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: unreadable or truncated file, empty archive, an array of non-integer dtype,
            a rank other than 3, or empty (naming the array), arrays whose layer counts differ
            (naming both arrays and shapes), a layer dimension above a declared
            ``num_layers``, an expert outside ``[-1, num_experts)`` or an outlier expert (the
            message gives its ``[token, layer, k]`` index), or (:class:`MemoryLimitError`) a
            size above ``max_memory``.
    """
    path_str = os.fspath(path)
    declared_layers = optional_positive_int(num_layers, "num_layers")
    declared_experts = optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)
    members = _array_file_members(path_str)
    for member in members:
        check_member(member)
        if member.shape[1] != members[0].shape[1]:
            raise TraceError(f"{member.label}: shape {member.shape} but {members[0].label} has "
                             f"shape {members[0].shape}: every sequence of one model routes the "
                             f"same layers")
    return Trace(**assemble_dense(members, path_str, declared_layers, declared_experts, limit,
                                  names=len(members) > 1))


def _array_file_members(path_str: str):
    """The arrays of one ``.npz`` (by its zip magic) or ``.npy`` file, headers only."""
    try:
        with open(path_str, "rb") as handle:
            magic = handle.read(2)
    except OSError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc
    return _npz_members(path_str) if magic == _ZIP_MAGIC else _npy_members(path_str)


def load_vllm_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                    num_experts: int | None = None, max_memory: int | None = None) -> Trace:
    """Read vLLM's routed experts: one ``[gen_len, layers, top_k]`` array per request, each
    request one sequence.

    vLLM (``--enable-return-routed-experts``) returns each completion's ``routed_experts`` as an
    int16 array ``[gen_len, num_moe_layers, top_k]``. Saved as a directory of ``.npy`` files (one
    per request, named after the file without ``.npy``, in name order; other files are ignored),
    an ``.npz`` (one array per request, in archive order) or one ``.npy``. Unlike
    :func:`load_array_trace`, every request must have the same layers and ``top_k`` (one model's
    routing), and a request with ``gen_len`` 0 is skipped. Headers (dtype, rank, shapes) are
    checked for every request before any data is read.

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: no ``.npy`` in the directory, a non-integer dtype or a rank other than 3
            (naming the file and shape), requests whose layers or ``top_k`` differ (naming both
            files and shapes), every request empty, an id below ``-1`` (naming the file and
            ``[token, layer, k]``), or as :func:`load_array_trace`.
    """
    path_str = os.fspath(path)
    declared_layers = optional_positive_int(num_layers, "num_layers")
    declared_experts = optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)
    if os.path.isdir(path_str):
        try:
            files = sorted(f for f in os.listdir(path_str) if f.lower().endswith(".npy"))
        except OSError as exc:
            raise TraceError(f"{path_str}: cannot list the directory: {exc.strerror or exc}") from exc
        if not files:
            raise TraceError(f"{path_str}: no .npy files in the directory (vLLM routed experts: "
                             f"one [gen_len, layers, top_k] .npy per request)")
        members = [member for name in files
                   for member in _npy_members(os.path.join(path_str, name), name[:-4],
                                              os.path.join(path_str, name))]
    else:
        members = _array_file_members(path_str)
    for member in members:
        check_member(member, tokens="gen_len", empty_tokens=True)
        if member.shape[1:] != members[0].shape[1:]:
            raise TraceError(f"{member.label}: shape {member.shape} but {members[0].label} has "
                             f"shape {members[0].shape}: every request of one model routes the "
                             f"same [layers, top_k]")
    kept = [member for member in members if member.shape[0] > 0]
    if not kept:
        raise TraceError(f"{path_str}: every request has gen_len 0 (no routes)")
    return Trace(**assemble_dense(kept, path_str, declared_layers, declared_experts, limit,
                                  names=len(members) > 1 or os.path.isdir(path_str)))


def save_array_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write a full-grid trace (:meth:`Trace.is_dense`) as ``.npy`` (one array) or ``.npz``
    (array ``routes``, compressed), by the suffix."""
    path_str = os.fspath(path)
    if os.path.splitext(path_str)[1].lower() == ".npz":
        np.savez_compressed(path_str, routes=trace.to_dense())
    else:
        np.save(path_str, trace.to_dense())
