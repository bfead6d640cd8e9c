"""The ``backend=`` switch of the ops (docs/semantics.md §7): ``"xla"`` (the XLA step),
``"pallas"`` (the fused kernel of :mod:`~pallas_cache.kernels.step`, Triton lowering, GPU) or
``"interpret"`` (that kernel under the Pallas interpreter); ``None`` picks the platform's."""

from __future__ import annotations

import jax

__all__ = ["BACKENDS", "has_pallas_triton", "resolve_backend"]

BACKENDS = ("xla", "pallas", "interpret")


def has_pallas_triton() -> bool:
    """Whether the installed JAX has the Pallas Triton backend the fused kernel lowers through."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend) -> str:
    """``None`` -> ``"pallas"`` on GPU (with the Pallas Triton backend), else ``"xla"``; anything
    unknown raises ValueError, and so does an explicit ``"pallas"``/``"interpret"`` on a JAX
    without the Pallas Triton backend."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" and has_pallas_triton() else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
    if backend != "xla" and not has_pallas_triton():
        raise ValueError(f"backend {backend!r} needs the Pallas Triton backend "
                         f"(jax.experimental.pallas.triton), which this JAX {jax.__version__} "
                         f"lacks; use backend='xla'")
    return backend
