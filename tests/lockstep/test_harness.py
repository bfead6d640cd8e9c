"""The test harness itself (conftest.py): the evictions under test come from the registry, and a
policy added before collection is under every eviction-parametrised test it applies to."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pallas_cache as pc
from tests.harness import assert_same, evictions_under_test
from pallas_cache import reference
from pallas_cache.testing.lockstep import record_difference

TESTS = Path(__file__).resolve().parents[1]
#: The test files with eviction-parametrised tests.
EVICTION_FILES = ("tests/core/test_eviction.py", "tests/core/test_route_knn.py",
                  "tests/kernels/test_kernels.py", "tests/lockstep/test_lockstep.py")

#: Registers a toy policy (MRU: the most recently used resident goes first; tests/toy_policies.py,
#: not a test module, so none is imported before collection) and its reference twin, and
#: writes, per eviction-parametrised item, its test, its other parameters and its eviction.
TOY_PLUGIN = '''
import json

from tests.toy_policies import MRU, REFERENCE_MRU


def pytest_configure(config):
    from tests import harness  # the module the copied tests' conftest.py re-exports from

    harness.add_eviction_under_test(MRU, REFERENCE_MRU)


def pytest_collection_modifyitems(items):
    rows = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "eviction" in params:
            eviction = params["eviction"]
            others = sorted((k, repr(v)) for k, v in params.items() if k != "eviction")
            rows.append([item.originalname, others, getattr(eviction, "name", eviction)])
    with open("eviction_items.json", "w") as f:
        json.dump(rows, f)
'''


def test_the_evictions_under_test_are_the_registry():
    """FAILS if a list of evictions is not the ``Eviction`` registry, or a filter is wrong."""
    names = lambda **f: [p.id for p in evictions_under_test(**f)]  # noqa: E731
    assert names() == [e.value for e in pc.Eviction]
    assert names(kernel=True) == ["lru", "pair_lfu", "route_knn", "route_lfu"]
    assert names(kernel=False) == []
    assert names(ring=True) == ["route_knn", "route_lfu"]
    assert names(default=False) == ["pair_lfu", "route_knn", "route_lfu"]


def test_a_policy_added_before_collection_is_under_every_eviction_test(tmp_path):
    """FAILS if an eviction-parametrised test names its evictions by hand: a toy policy (MRU: no
    kernel ranking, no ring, not the default) registered by a plugin must join every parameter
    group of every test whose list is not restricted to kernel-ranked or ring policies."""
    shutil.copytree(TESTS, tmp_path / "tests", ignore=shutil.ignore_patterns("data", "__pycache__"))
    (tmp_path / "toy_plugin.py").write_text(TOY_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS.parent)])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "toy_plugin", "--collect-only",
                          "-q", "-p", "no:cacheprovider", *EVICTION_FILES], cwd=tmp_path,
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    groups: dict = {}
    for test, others, eviction in json.loads((tmp_path / "eviction_items.json").read_text()):
        groups.setdefault((test, json.dumps(others)), set()).add(eviction)
    # MRU has no kernel ranking, no ring and is not the default: a filter admits it unless it
    # asks for one of those (read off each test's decorator).
    admits = {}
    for name in EVICTION_FILES:
        source = (TESTS.parent / name).read_text()
        for args, test in re.findall(r"evictions_under_test\(([^)]*)\)\)\n(?:@.*\n)*def (\w+)",
                                     source):
            admits[test] = "True" not in args
    assert len(admits) == len({test for test, _ in groups}), (admits, groups.keys())
    for (test, others), evictions in groups.items():
        assert ("mru" in evictions) == admits[test], (test, others, evictions)
    picked = sorted({test for (test, _), evictions in groups.items() if "mru" in evictions})
    assert picked, groups
    print(f"the toy policy joins {sum('mru' in e for e in groups.values())} items of "
          f"{len(picked)} of the {len(admits)} eviction-parametrised tests: {picked}")


def test_the_reference_state_has_the_library_parts():
    """FAILS if the reference's state parts or their fields differ from ``CacheState``'s (a field
    added on one side only would escape the lockstep comparison, which walks both records'
    fields): every leaf path of a library state is an attribute path of the reference's."""
    state = reference.init(2, 3, 4, eviction="route_lfu", history=2)
    library = pc.init(2, 3, 4, eviction="route_lfu", history=2)
    for part in dataclasses.fields(pc.CacheState):
        mine = getattr(library, part.name)
        theirs = getattr(state, part.name)
        # The eviction record and its bookkeeping are twins by design, not the same fields: the
        # reference's record ranks in Python (``rank``), the library's in arrays and the kernel.
        if dataclasses.is_dataclass(mine) and part.name not in ("eviction", "eviction_state"):
            assert ({f.name for f in dataclasses.fields(mine)}
                    == {f.name for f in dataclasses.fields(theirs)}), part.name
    # A field on the reference only is caught too: the lockstep walk reads the library's names.
    assert record_difference(state, library) is None
    library_ring = {f.name for f in dataclasses.fields(pc.evictions.TokenRingState)}
    reference_ring = {f.name for f in dataclasses.fields(reference.TokenRingState)}
    assert library_ring - reference_ring == {"masks", "match"}  # the two kept in another form
    assert reference_ring - library_ring == {"ring"}


def test_assert_same_sees_every_field_nested_and_one_sided():
    """FAILS if the one comparison misses a differing nested field (the ring, an eviction
    field), a field on one side only, or a different eviction."""
    jax_state = pc.init(2, 3, 4, eviction="route_knn", history=2)
    ref = reference.init(2, 3, 4, eviction="route_knn", history=2)
    assert_same(jax_state, ref)
    for change in (lambda s: setattr(s.eviction_state, "head", 1),
                   lambda s: s.eviction_state.ring.__setitem__((0, 1, 2), True),
                   lambda s: setattr(s, "eviction", reference.evictions.POLICIES["route_lfu"]),
                   lambda s: s.stats.__setitem__((1, 3), 7)):
        other = reference.copy_state(ref)
        change(other)
        with pytest.raises(AssertionError):
            assert_same(jax_state, other)
    with pytest.raises(AssertionError, match="one side"):
        assert_same(pc.init(2, 3, 4, eviction="route_knn").eviction_state,
                    reference.init(2, 3, 4, eviction="route_lfu").eviction_state)
