"""The fused kernel's interface (docs/design.md, "Backends and kernels"): the state goes in and
comes out as one pytree of named refs whose aliases follow the tree, the backend choice lives in
kernels/dispatch.py, and the kernel module imports no op."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallas_cache as pc
from benchmarks.lowering import lower_cuda
from pallas_cache import evictions
from pallas_cache.kernels import dispatch
from pallas_cache.kernels import step as fused

ROOT = Path(__file__).resolve().parents[2] / "pallas_cache"
# The fused kernel's modules: its refs and call, its phases, its searches.
KERNEL_STEP = tuple(ROOT / "kernels" / name for name in ("step.py", "phases.py", "search.py"))


@pytest.mark.parametrize("eviction", ["lru", "pair_lfu"])
def test_every_state_leaf_is_aliased_to_its_own_output(eviction):
    """FAILS if a state leaf the kernel writes is not aliased in place, or is aliased to another
    leaf's output (a positional alias list that misses the eviction's tables or is off by one):
    the lowered call's aliases are exactly ``input i -> output j`` for the ``j``-th state leaf,
    with equal shapes and dtypes."""
    state = pc.init(3, 5, 7, eviction=eviction)
    ranking = state.eviction.kernel
    leaves = jax.tree.leaves(fused._state_refs(state, ranking))
    routes = jnp.arange(3, dtype=jnp.int32)
    text = lower_cuda(lambda s: pc.ensure(s, 1, routes, backend="pallas"), state).as_text()
    pairs = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d+)\], "
                       r"operand_index = (\d+)", text)
    assert sorted(int(o) for o, _ in pairs) == list(range(len(leaves))), pairs
    num_call = len(fused.CallRefs._fields)
    assert {int(o): int(i) for o, i in pairs} == {j: num_call + j for j in range(len(leaves))}
    # The tables are real leaves: PAIR_LFU's two make nine, LRU's none seven.
    assert len(leaves) == 7 + len(ranking.tables(state.eviction_state))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_no_import_circle_between_the_ops_and_the_kernel():
    """FAILS if the kernel module imports the ops (the circle of a reference wrapper) or the ops
    import the kernel module themselves rather than through kernels/dispatch.py."""
    assert not {m for path in KERNEL_STEP for m in _imports(path)
                if m == "pallas_cache.ops" or m.startswith("pallas_cache.ops.")}
    assert "pallas_cache.kernels.step" not in _imports(ROOT / "ops.py")
    assert not hasattr(fused, "fused_step_reference")


def test_the_plans_are_below_the_ops_and_both_steps():
    """FAILS if the fused kernel or the hybrid layer imports the ops or the XLA step for a plan
    class (an import circle once the step left ops.py), or if the kernel returns anything but
    the plan record."""
    for path in (*KERNEL_STEP, ROOT / "hybrid.py"):
        assert not {m for m in _imports(path) if m.split(".")[:2] in (["pallas_cache", "ops"],
                                                                     ["pallas_cache", "step"])}
    state = pc.init(2, 4, 6)
    rules = pc.ops.Rules.of(hybrid=True, order="recency", admission="promote_one")
    _, plan = fused.fused_step(state, jnp.int32(1), jnp.asarray([0, 2, -1], jnp.int32),
                               pc.FetchPolicy.fraction(0.5), rules, interpret=True)
    assert isinstance(plan, pc.EnsurePlan) and plan.copy.num_slots == 6


def test_the_backend_choice_is_dispatch_s():
    """FAILS if ``fused_step_for`` runs the kernel on ``"xla"``, for traced rules or a ring
    longer than the kernel holds, or skips it for a ring eviction it holds, or does not hand
    back the interpreter for ``"interpret"``."""
    state = pc.init(2, 4, 6)
    rules = pc.ops.Rules.of(hybrid=False, order="lowest_id", admission="none")
    assert dispatch.fused_step_for(state, rules, 3, "xla") is None
    assert dispatch.fused_step_for(pc.init(2, 4, 6, eviction="route_lfu"), rules, 3,
                                   "pallas") is not None
    assert dispatch.fused_step_for(pc.init(2, 4, 6, eviction="route_lfu", history=4097), rules,
                                   3, "pallas") is None
    assert dispatch.fused_step_for(state, rules, 0, "pallas") is None
    traced = dataclasses.replace(rules, hybrid=jnp.bool_(True))
    assert dispatch.fused_step_for(state, traced, 3, "pallas") is None
    step = dispatch.fused_step_for(state, rules, 3, "interpret")
    assert step is not None and step.keywords == {"interpret": True}
    assert dispatch.fused_step_for(state, rules, 3, "pallas").keywords == {"interpret": False}


def _triton_ir(state, call) -> str:
    """The kernel's Triton IR as Pallas lowers it for CUDA (no GPU needed)."""
    from jax._src.pallas.triton import lowering

    modules, original = [], lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        lower_cuda(call, state)
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    assert len(modules) == 1
    return modules[0]


@pytest.mark.parametrize("capacity", [64, 16384])
def test_the_gpu_path_orders_its_read_after_writes_with_barriers(capacity):
    """FAILS if a CTA barrier of the GPU path is missing (the kernel would read a stamp or a map
    entry that another thread has not yet written or has already overwritten, which the
    interpreter cannot show): after the rebase branch, after the hit refresh, before the map
    scatters: three ``gpu.barrier``, in that order around the stores they separate."""
    state = pc.init(4, 16, capacity)
    routes = jnp.arange(8, dtype=jnp.int32)
    ir = _triton_ir(state, lambda s: pc.ensure_hybrid(s, 1, routes, pc.FetchPolicy.full(),
                                                       backend="pallas"))
    lines = ir.splitlines()
    barriers = [i for i, x in enumerate(lines) if "gpu.barrier" in x]
    assert len(barriers) == 3, barriers
    # the rebase's branch: the first (the victim rounds' exact fallbacks come after the barriers)
    rebase = min(i for i, x in enumerate(lines) if "scf.if" in x)
    assert rebase < barriers[0]
    # a store (the hit refresh) between the first two, the map scatters after the last
    assert any("tt.store" in x for x in lines[barriers[0]:barriers[1]])
    assert any("tt.store" in x for x in lines[barriers[2]:])


def test_per_call_inputs_are_checked_where_the_record_is_made_and_where_the_kernel_runs():
    """FAILS if a record may ask for a per-call input the kernel does not compute (a typo would
    surface as an AttributeError deep in a trace) or name one by a plain string instead of a
    ``PerCall`` member, or if an eviction without a token ring that asks for one reaches the
    kernel instead of a TypeError naming its bookkeeping."""
    ranking = pc.evictions.Eviction.ROUTE_KNN.policy.kernel
    for bad in (("next_uses",), "next_use", ("next_use",), evictions.PerCall.NEXT_USE):
        with pytest.raises(ValueError, match=r"KernelRanking.per_call must be a tuple of PerCall"):
            dataclasses.replace(ranking, per_call=bad)
    lru = pc.evictions.Eviction.LRU.policy
    record = dataclasses.replace(lru, name="lru_per_call", allows_reuse=False,
                                 kernel=dataclasses.replace(
                                     lru.kernel, per_call=(evictions.PerCall.NEXT_USE,)))
    state = pc.init(2, 4, 6, eviction=record)
    rules = pc.ops.Rules.of(hybrid=False, order="lowest_id", admission="none")
    with pytest.raises(TypeError, match="needs a TokenRingState.*got NoneType"):
        dispatch.fused_step_for(state, rules, 3, "pallas")


def test_the_kernels_ring_names_no_eviction_and_hands_the_key_typed_inputs():
    """FAILS if kernels/ring.py imports a particular eviction's module (ROUTE_KNN's
    ``NEIGHBOURS`` from ``evictions.route_knn``, as it once did) instead of the ring's shared
    constants in ``evictions/ring.py``, or if ``per_slot`` hands the key a namespace instead of
    a ``PerCallInputs`` with ``None`` for the inputs the record did not ask for."""
    from pallas_cache.evictions import ring, route_knn
    from pallas_cache.kernels import ring as kernel_ring

    names = {"lru", "pair_lfu", "route_knn", "route_lfu"}
    imported = {m.rsplit(".", 1)[-1] for m in _imports(ROOT / "kernels" / "ring.py")
                if m.startswith("pallas_cache.evictions")}
    assert not imported & names, imported
    assert route_knn.NEIGHBOURS is ring.NEIGHBOURS == kernel_ring.NEIGHBOURS
    source = (ROOT / "evictions" / "route_knn.py").read_text()
    assert not re.search(r"^NEIGHBOURS\s*=", source, flags=re.M)
    for text in (path.read_text() for path in (ROOT / "kernels" / "ring.py", *KERNEL_STEP)):
        assert "SimpleNamespace" not in text
    assert kernel_ring.per_slot(None, None, None, (), num_layers=2, num_experts=4) is None
    inputs = evictions.PerCallInputs(num_layers=2, next_use=jnp.int32(1))
    assert inputs.prot is None and inputs.freq is None
