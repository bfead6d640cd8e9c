"""Counting the rows a traced program reads from a bank.

:func:`rows_read` runs a program (its jaxpr) with an interpreter that steps through every loop
and branch as the compiled program would, and adds up the elements that each operation taking
the bank reads from it: a slice reads its output, anything else the whole bank. Counting what
runs, not what the code says, makes a copy rule structural: a loop over a plan's width reads its
padding even where a scatter drops it. A ``shard_map`` is run as one device's program (the
``device`` argument: its blocks of the sharded inputs, its ``axis_index``). Used by
tests/core/test_copy_path.py and tests/core/mesh_checks.py. :func:`whole_matrix_ops` finds
the operations of a compiled program that make an array the size of a whole stored matrix
(tests/core/test_experts.py, tests/benchmarks/test_hybrid_vmap.py).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

_SLICES = ("dynamic_slice", "slice", "gather")
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "call", "fun_jaxpr")
_IDENTITIES = ("pvary", "pcast")  # mesh-axis type casts (values unchanged)


@dataclasses.dataclass
class _Run:
    device: int  # the mesh position whose program a shard_map runs (its only axis)
    elements: int = 0  # bank elements read so far


def rows_read(fn, *args, bank: int, row_size: int, device: int = 0) -> int:
    """How many rows of ``row_size`` elements running ``fn(*args)`` reads from ``args[bank]``
    (every leaf of it). Inside a ``shard_map`` (one mesh axis) only device ``device``'s program
    runs; its outputs stand for the whole (so the ``shard_map`` should end the program)."""
    closed = jax.make_jaxpr(fn)(*args)
    flat_args, marks = [], []
    for i, arg in enumerate(args):
        leaves = jax.tree.leaves(arg)
        flat_args += leaves
        marks += [i == bank] * len(leaves)
    run = _Run(device)
    _eval(closed.jaxpr, closed.consts, flat_args, marks, run)
    assert run.elements % row_size == 0, (run.elements, row_size)
    return run.elements // row_size


def _eval(jaxpr, consts, args, marks, run):
    """Run ``jaxpr`` on ``args``; ``marks[i]`` says argument ``i`` is (a leaf of) the bank.
    Returns the outputs."""
    env, bank = {}, set()

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a, m in zip(jaxpr.invars, args, marks):
        env[v] = a
        if m:
            bank.add(v)
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        in_marks = [not isinstance(v, jax.extend.core.Literal) and v in bank for v in eqn.invars]
        if eqn.primitive.name in _IDENTITIES:  # the same values: the bank stays the bank
            outs = list(vals)
            bank.update(o for o, m in zip(eqn.outvars, in_marks) if m)
        else:
            outs = _eval_eqn(eqn, vals, in_marks, run)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn, vals, marks, run):
    name, params = eqn.primitive.name, eqn.params
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond, body = params["cond_jaxpr"], params["body_jaxpr"]
        carry, carry_marks = vals[nc + nb:], marks[nc + nb:]
        # a batched predicate (vmap of the loop) runs while any member's is true, as lowered
        while np.any(np.asarray(_eval(cond.jaxpr, cond.consts, vals[:nc] + carry,
                                      marks[:nc] + carry_marks, run)[0])):
            carry = _eval(body.jaxpr, body.consts, vals[nc:nc + nb] + carry,
                          marks[nc:nc + nb] + carry_marks, run)
        return carry
    if name == "cond":
        branches = params["branches"]
        branch = branches[int(np.clip(int(vals[0]), 0, len(branches) - 1))]
        return _eval(branch.jaxpr, branch.consts, vals[1:], marks[1:], run)
    if name == "scan":
        return _eval_scan(params, vals, marks, run)
    if name == "shard_map":
        (axis,) = params["mesh"].axis_names
        size = params["mesh"].shape[axis]
        local = [_block(v, spec, axis, size, run.device)
                 for v, spec in zip(vals, params["in_specs"])]
        return _eval(params["jaxpr"], (), local, marks, run)
    if name == "axis_index":
        return [jnp.int32(run.device)]
    for key in _CALL_PARAMS:
        sub = params.get(key)
        if isinstance(sub, jax.extend.core.ClosedJaxpr) and len(sub.jaxpr.invars) == len(vals):
            return _eval(sub.jaxpr, sub.consts, vals, marks, run)
    for val, marked in zip(vals, marks):
        if marked:
            out = eqn.outvars[0].aval
            run.elements += math.prod(out.shape) if name in _SLICES else math.prod(val.shape)
    out = eqn.primitive.bind(*vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _block(value, spec, axis, size, device):
    """Device ``device``'s block of ``value`` under the ``PartitionSpec`` ``spec`` (sharded at
    most on its first dimension, over the mesh's one ``axis`` of ``size`` devices)."""
    if not spec or spec[0] is None:
        assert all(s is None for s in spec), spec
        return value
    assert spec[0] == axis and all(s is None for s in spec[1:]), spec
    step = value.shape[0] // size
    return value[device * step:(device + 1) * step]


def _eval_scan(params, vals, marks, run):
    body, length = params["jaxpr"], params["length"]
    if "num_consts" in params:
        nc, ncarry = params["num_consts"], params["num_carry"]
    else:  # jax >= 0.11: a flat tree of the operands' groups (consts, carry, xs)
        consts, carry, _ = params["ft_in"].update(list(range(len(vals)))).unpack()
        nc, ncarry = len(list(consts)), len(list(carry))
    consts, carry, xs = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]
    assert not any(marks[nc + ncarry:]), "the bank as a scanned-over operand"
    in_marks = marks[:nc + ncarry] + [False] * len(xs)
    steps = range(length - 1, -1, -1) if params["reverse"] else range(length)
    ys = []
    for i in steps:
        out = _eval(body.jaxpr, body.consts, consts + carry + [x[i] for x in xs], in_marks, run)
        carry = out[:ncarry]
        ys.append(out[ncarry:])
    if params["reverse"]:
        ys.reverse()
    return carry + [jnp.stack([y[k] for y in ys]) for k in range(len(ys[0]))] if ys else carry


_WHOLE = re.compile(r"=\s*\w+\[([\d,]+)\]")


def whole_matrix_ops(hlo: str, size: int) -> list[str]:
    """Lines of optimized HLO that compute an array of at least one whole stored matrix
    (``size`` elements), other than the parameters and the loop/tuple plumbing that pass the
    bank along."""
    found = []
    for line in hlo.splitlines():
        if re.search(r"parameter\(|get-tuple-element\(|tuple\(|while\(|conditional\(|"
                     r"bitcast\(|call\(|custom-call\(", line):
            continue
        for dims in _WHOLE.findall(line):
            if np.prod([int(d) for d in dims.split(",")]) >= size:
                found.append(line.strip()[:160])
    return found
