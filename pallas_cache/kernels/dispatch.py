"""The ``backend=`` switch of the ops (docs/semantics.md §7): ``"xla"`` (the XLA step),
``"pallas"`` (the fused kernel of :mod:`~pallas_cache.kernels.step`, Triton lowering, GPU) or
``"interpret"`` (that kernel under the Pallas interpreter); ``None`` picks the platform's."""

from __future__ import annotations

import functools

import jax

__all__ = ["BACKENDS", "fused_step_for", "has_pallas_triton", "resolve_backend"]

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


def fused_step_for(state, rules, num_routes: int, backend: str, *, in_shard_map: bool = False):
    """The fused kernel's step for this call on ``backend`` (a resolved name), or ``None`` when the
    XLA step runs: on ``"xla"``, inside a ``shard_map`` body (``in_shard_map``: the kernel's body
    does not type-check under ``check_vma``; docs/design.md, "Several devices"), and for calls the
    kernel does not run (traced rules, an eviction without kernel hooks, no route:
    :func:`~pallas_cache.kernels.step.supports`). The returned callable takes ``(state, layer,
    routes, policy, rules)`` as :func:`~pallas_cache.kernels.step.fused_step`."""
    if backend == "xla" or in_shard_map:
        return None
    from pallas_cache.kernels import step  # imports the Pallas Triton backend

    if not step.supports(state, rules, num_routes):
        return None
    return functools.partial(step.fused_step, interpret=backend == "interpret")
