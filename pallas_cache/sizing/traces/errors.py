"""The error every trace reader raises, and what a corrupt or hostile file can raise while it is
read."""

from __future__ import annotations

import lzma
import tokenize
import zipfile
import zlib

__all__ = ["READ_ERRORS", "TraceError"]


class TraceError(ValueError):
    """A trace file or trace array that cannot be read as a routing trace.

    The message says where (file, line or array index) and what (the field and the value), e.g.
    ``"trace.jsonl:12: field 'experts': expert 9 is outside [-1, 8) (num_experts=8)"``.
    """

#: What a corrupt or hostile file can raise while being read (gzip, zip, npy header parsing).
READ_ERRORS = (OSError, EOFError, ValueError, TypeError, SyntaxError, RecursionError,
                OverflowError, zipfile.BadZipFile, zlib.error, lzma.LZMAError,
                tokenize.TokenError, NotImplementedError, RuntimeError)
