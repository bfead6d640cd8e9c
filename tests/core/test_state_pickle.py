"""A state pickles: checkpointed, or sent to another process, it loads as an equal state whose
eviction record is the registry's own, and the ops accept it (docs/semantics.md §3)."""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import subprocess
import sys

import jax
import numpy as np
import pytest

import pallas_cache as pc

ROOT = pathlib.Path(__file__).resolve().parents[2]
EVICTIONS = [e.value for e in pc.Eviction]


def _warm(eviction: str):
    """A state of every eviction that has seen a few calls (its bookkeeping is not cold)."""
    state = pc.init(2, 4, 6, eviction=eviction, history=4)
    for layer, ids in ((0, [1, 2]), (1, [0, 3]), (0, [2, 3])):
        state, _ = pc.ensure(state, layer, ids)
    return state


def _same(a, b) -> bool:
    """Equal tree structure (the static eviction record included) and equal leaves."""
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(x, y) and np.asarray(x).dtype == np.asarray(y).dtype
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_a_state_of_every_eviction_round_trips_through_pickle(eviction):
    """FAILS if the state's eviction record holds lambdas (``PicklingError: Can't pickle
    <function <lambda>>``), or loads as a copy of the record rather than the registry's own
    (a state with a copied record would retrace every op and ``pc.Eviction(record)`` fails):
    the loaded state equals the original, and the next call on it gives the same state and
    plan as on the original."""
    state = _warm(eviction)
    loaded = pickle.loads(pickle.dumps(state))
    assert loaded.eviction is state.eviction
    assert pc.Eviction(loaded.eviction).value == eviction
    assert _same(loaded, state)
    assert _same(pc.ensure(loaded, 1, [1, 2]), pc.ensure(state, 1, [1, 2]))
    assert _same(pc.ensure_hybrid(loaded, 1, [0, 2], pc.FetchPolicy.fraction(0.5)),
                 pc.ensure_hybrid(state, 1, [0, 2], pc.FetchPolicy.fraction(0.5)))


@pytest.mark.parametrize("eviction", ["lru", "route_lfu"])
def test_a_batch_of_states_round_trips_through_pickle(eviction):
    """FAILS if a stacked batch of states (``pc.stack_states``) cannot be pickled."""
    batch = pc.stack_states([_warm(eviction), pc.init(2, 4, 6, eviction=eviction, history=4)])
    loaded = pickle.loads(pickle.dumps(batch))
    assert _same(loaded, batch)
    assert _same(pc.take_state(loaded, 0), _warm(eviction))


def test_a_record_outside_the_registry_pickles_field_by_field():
    """FAILS if only registered records pickle: a record made from one (module-level
    functions, another name) loads as an equal record."""
    record = dataclasses.replace(pc.Eviction.PAIR_LFU.policy, name="pair_lfu_copy")
    loaded = pickle.loads(pickle.dumps(record))
    assert loaded == record and loaded is not record


def test_a_pickled_state_is_accepted_by_a_fresh_process(tmp_path):
    """FAILS if a state cannot be sent to another Python process: a fresh interpreter loads the
    pickled state of every eviction, runs one ``ensure`` on it and pickles the result back,
    which equals the same call in this process."""
    states = {eviction: _warm(eviction) for eviction in EVICTIONS}
    sent, back = tmp_path / "states.pkl", tmp_path / "results.pkl"
    sent.write_bytes(pickle.dumps(states))
    script = ("import pickle, sys\n"
              "import pallas_cache as pc\n"
              "states = pickle.loads(open(sys.argv[1], 'rb').read())\n"
              "out = {e: pc.ensure(s, 1, [1, 2]) for e, s in states.items()}\n"
              "open(sys.argv[2], 'wb').write(pickle.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script, str(sent), str(back)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = pickle.loads(back.read_bytes())
    for eviction, state in states.items():
        assert _same(results[eviction], pc.ensure(state, 1, [1, 2])), eviction
