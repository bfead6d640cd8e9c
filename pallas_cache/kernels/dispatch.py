"""The ``backend=`` switch of the ops (docs/semantics.md §7): ``"xla"`` (the XLA step),
``"pallas"`` (the fused kernel of :mod:`~pallas_cache.kernels.step`, Triton lowering, GPU) or
``"interpret"`` (that kernel under the Pallas interpreter); ``None`` picks the platform's."""

from __future__ import annotations

import functools

import jax

__all__ = ["BACKENDS", "TRITON_DEPRECATION", "check_runs_here", "fused_step_for",
           "has_pallas_triton", "import_kernel", "resolve_backend", "triton_deprecation_is_error"]

BACKENDS = ("xla", "pallas", "interpret")


#: JAX's deprecation id of the Pallas Triton backend (jax >= 0.11; docs/backends.md).
TRITON_DEPRECATION = "jax-pallas-triton"


def triton_deprecation_is_error() -> bool:
    """Whether this JAX turns the Pallas Triton deprecation into an error at lowering
    (``jax._src.deprecations.accelerate("jax-pallas-triton")``); False on a JAX without it."""
    try:
        from jax._src import deprecations

        return bool(deprecations.is_accelerated(TRITON_DEPRECATION))
    except Exception:  # no such module, function or id: the deprecation is not an error here
        return False


def has_pallas_triton() -> bool:
    """Whether the installed JAX has the Pallas Triton backend the fused kernel lowers through,
    usable: importable, and its deprecation not made an error."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return not triton_deprecation_is_error()


def resolve_backend(backend) -> str:
    """``None`` -> ``"pallas"`` on GPU (with a usable Pallas Triton backend), else ``"xla"``;
    anything unknown raises ValueError, and so does an explicit ``"pallas"``/``"interpret"``
    where the Pallas Triton backend is missing or its deprecation is an error."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" and has_pallas_triton() else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
    if backend != "xla" and not has_pallas_triton():
        why = ("makes the deprecation of the Pallas Triton backend an error "
               f"({TRITON_DEPRECATION!r})" if triton_deprecation_is_error() else
               "lacks the Pallas Triton backend (jax.experimental.pallas.triton)")
        raise ValueError(f"backend {backend!r} needs the Pallas Triton backend, and this JAX "
                         f"{jax.__version__} {why}; use backend='xla' (or None), or install "
                         f"jax<0.13 without the deprecation made an error (docs/backends.md)")
    return backend


def check_runs_here(backend: str, state) -> str:
    """``backend`` (resolved), refused for an eager call (a state of concrete arrays, which
    compiles and runs now) under ``"pallas"`` where no GPU is in sight: the kernel compiles for
    a GPU only, and JAX would answer "Only interpret mode is supported" from inside the
    compile. Under a trace any backend may be traced and lowered (for another platform too)."""
    if backend != "pallas" or isinstance(state.clock.step, jax.core.Tracer) or _gpu_in_sight():
        return backend
    raise ValueError(f"backend 'pallas' compiles the fused kernel for a GPU, and JAX's default "
                     f"backend here is {jax.default_backend()!r}: use backend='interpret' (the "
                     f"same kernel in the Pallas interpreter) or 'xla' (or None, the platform's "
                     f"default)")


def _gpu_in_sight() -> bool:
    """A GPU is the default backend, or the abstract mesh in use is of GPUs."""
    if jax.default_backend() == "gpu":
        return True
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) == "gpu"


def import_kernel() -> None:
    """Import the fused kernel's module where this JAX has the Pallas Triton backend (once, with
    the ops: see the end of ``pallas_cache.ops``)."""
    try:
        from pallas_cache.kernels import step  # noqa: F401
    except ImportError:
        return
    try:
        # The Pallas interpreter imports the fuser on its first call; its import inside a trace
        # changes the compile-cache key (jax 0.12), and the first jitted step compiles twice.
        import jax.experimental.pallas.fuser  # noqa: F401
    except ImportError:
        pass


def fused_step_for(state, rules, num_routes: int, backend: str, *,
                   mesh_axes: frozenset = frozenset()):
    """The fused kernel's step for this call on ``backend`` (a resolved name), or ``None`` when the
    XLA step runs: on ``"xla"``, for calls the kernel does not run (traced rules, an eviction
    without kernel hooks, no route: :func:`~pallas_cache.kernels.step.supports`), and on
    ``"interpret"`` when the call's inputs vary over mesh axes (``mesh_axes``, inside a
    ``shard_map`` with ``check_vma``: the Pallas interpreter evaluates the kernel's body on them
    and refuses its constants beside them). On ``"pallas"`` the kernel runs inside a
    ``shard_map`` too, its outputs typed as its inputs vary (docs/design.md, "Several devices").
    The returned callable takes ``(state, layer, routes, policy, rules)`` as
    :func:`~pallas_cache.kernels.step.fused_step`."""
    if backend == "xla" or (backend == "interpret" and mesh_axes):
        return None
    from pallas_cache.kernels import step  # imports the Pallas Triton backend

    if not step.supports(state, rules, num_routes):
        return None
    return functools.partial(step.fused_step, interpret=backend == "interpret")
