"""The package's public surface keeps its hygiene: every callable of ``pallas_cache.__all__``,
``pallas_cache.testing.__all__`` and ``pallas_cache.testing.strategies.__all__`` annotated on
every parameter and its return (and the annotations resolve), ``py.typed`` shipped, one version,
a LICENSE that matches pyproject, short reprs of states and plans."""

from __future__ import annotations

import enum
import inspect
import re
import tomllib
import typing
from pathlib import Path

import jax
import numpy as np
import pytest

import pallas_cache as pc
import pallas_cache.testing as pct
import pallas_cache.testing.strategies as pcst
from pallas_cache import experts as pce

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = [pc, pct, pcst, pce]


def _functions(module) -> list[tuple[str, typing.Any]]:
    """Every public function of ``module.__all__``: the functions themselves, and each class's
    constructor and public methods defined in the package (enums: their own methods)."""
    found = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            found.append((name, inspect.unwrap(obj)))
        elif inspect.isclass(obj) and obj.__module__.startswith("pallas_cache"):
            for attr, member in vars(obj).items():
                if isinstance(member, (classmethod, staticmethod)):
                    member = member.__func__
                if not inspect.isfunction(member):
                    continue
                if attr.startswith("_") and attr != "__init__":
                    continue
                if issubclass(obj, enum.Enum) and attr == "__init__":
                    continue
                found.append((f"{name}.{attr}", member))
    return found


def missing_annotations(module) -> list[str]:
    missing = []
    for qualname, function in _functions(module):
        signature = inspect.signature(function)
        for parameter in signature.parameters.values():
            if parameter.name in ("self", "cls"):
                continue
            if parameter.annotation is inspect.Parameter.empty:
                missing.append(f"{module.__name__}.{qualname}: parameter {parameter.name}")
        if signature.return_annotation is inspect.Signature.empty:
            missing.append(f"{module.__name__}.{qualname}: return")
    return missing


@pytest.mark.parametrize("module", PUBLIC, ids=lambda m: m.__name__)
def test_every_public_callable_is_annotated(module):
    """FAILS if a function or method of the public namespaces lacks an annotation on a
    parameter or its return (e.g. ``def ensure(state, layer, expert_ids)``), or an annotation
    names something that does not resolve (a typo, a name imported under TYPE_CHECKING only)."""
    assert missing_annotations(module) == []
    for qualname, function in _functions(module):
        # hypothesis's st.composite wraps a strategy in a function of a generated module: the
        # public module's names resolve its annotations.
        names = {**vars(module), **function.__globals__}
        typing.get_type_hints(function, globalns=names)  # NameError if one does not resolve


def test_the_annotation_check_finds_a_missing_one():
    """FAILS if the check above passes an unannotated parameter or return (it would then pass
    on any package)."""
    import types

    def unannotated(state, layer: int):
        return state

    def no_return(state: int):
        return state

    module = types.SimpleNamespace(__name__="fake", __all__=["unannotated", "no_return"],
                                   unannotated=unannotated, no_return=no_return)
    assert missing_annotations(module) == [
        "fake.unannotated: parameter state", "fake.unannotated: return", "fake.no_return: return"]


def test_py_typed_is_shipped_and_the_version_is_written_once():
    """FAILS if ``py.typed`` is missing or not package data (mypy then reports "missing library
    stubs or py.typed marker"), or pyproject writes its own version instead of reading
    ``pallas_cache.__version__``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "pallas_cache" / "py.typed").is_file()
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["pallas_cache"]
    assert "version" not in config["project"]
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "pallas_cache.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", pc.__version__)


def test_the_license_file_matches_pyproject():
    """FAILS if LICENSE is missing, not the Apache License 2.0 text pyproject declares, or not
    listed as the license file."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["license"] == "Apache-2.0"
    assert config["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150


def test_the_testing_extra_is_in_the_test_extra():
    """FAILS if the ``testing`` extra (hypothesis, for pallas_cache.testing.strategies) is
    missing, or the ``test`` extra the suite installs lacks one of its packages."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(req.startswith("hypothesis") for req in extras["testing"])
    assert set(extras["testing"]) <= set(extras["test"])


def _fresh_python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (which must exit 0)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_only_the_strategies_module_imports_hypothesis():
    """FAILS if importing pallas_cache or pallas_cache.testing needs hypothesis (the core
    install has none): a fresh interpreter imports both with hypothesis blocked."""
    assert _fresh_python(
        "import sys; sys.modules['hypothesis'] = None\n"
        "import pallas_cache, pallas_cache.testing\n"
        "from pallas_cache.testing import moe_dense, check_plan, assert_states_equal\n"
        "try:\n    import pallas_cache.testing.strategies\nexcept ImportError:\n"
        "    print('blocked')\n") == "blocked"


def test_the_lockstep_module_imports_no_jax():
    """FAILS if importing ``pallas_cache.testing.lockstep`` imports JAX (NumPy only at import:
    the functions that run the library import it): a fresh interpreter imports it, and the kit's
    package, with JAX still unloaded. ``import pallas_cache`` loads its names on first use, so a
    module-level read of one (``pc.Eviction``) imports JAX too."""
    assert _fresh_python(
        "import sys\n"
        "import pallas_cache.testing.lockstep\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))[:3])\n"
    ) == "[]"


def test_reprs_are_short_and_name_shapes_and_counters():
    """FAILS if a state's repr dumps its arrays (the dataclass default: 17 fields of numbers),
    or a plan's hides its counters, or either breaks under jit or on a batch."""
    state = pc.init(2, 4, 6, capacity=8)
    state, plan = pc.ensure_hybrid(state, 0, np.array([1, 2, 2, -1]), pc.FetchPolicy.fraction(0.5))
    assert repr(state) == ("CacheState(L=2, E=4, S=6, C=8, eviction=lru, step=1, resident=1, "
                           "calls=1)")
    assert repr(plan) == (
        "EnsurePlan(slots=int32[4], cpu=bool[4], copy=CopyPlan(dst_slots=int32[4], "
        "src_rows=int32[4], count=1, num_slots=8, num_experts=4), active=2, missing=2, "
        "fetched=1, error=0)")
    batch = pc.stack_states([state, pc.init(2, 4, 6, capacity=8)])
    assert repr(batch).startswith("CacheState(batch=(2,), L=2, E=4, S=[6 6], C=8")
    assert "resident=[1 0]" in repr(batch)
    seen = []
    jax.jit(lambda s: seen.append(repr(s)) or s)(state)
    assert seen == ["CacheState(L=2, E=4, S=?, C=8, eviction=lru, step=?)"]
    assert len(repr(pc.init(8, 64, 512))) < 120


def test_records_declare_their_constructor_and_replace_for_type_checkers():
    """FAILS if a record of the package is invisible to type checkers as a dataclass (mypy then
    rejects ``FetchPolicy(fraction16=..., cap=...)`` and ``state.replace(...)``): the decorator
    must carry dataclass_transform, and every ``@pytree_dataclass`` class must derive from
    ``tree.Record``, which declares ``replace``."""
    import importlib

    from pallas_cache import tree

    # Python 3.12+ records frozen_default as a field of the transform, 3.11 among its kwargs.
    transform = tree.pytree_dataclass.__dataclass_transform__
    assert transform.get("frozen_default", transform.get("kwargs", {}).get("frozen_default")) is True
    found = []
    for path in sorted((ROOT / "pallas_cache").rglob("*.py")):
        names = re.findall(r"^@pytree_dataclass\nclass (\w+)", path.read_text(), re.M)
        if names:
            module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = importlib.import_module(module_name.removesuffix(".__init__"))
            found += [getattr(module, name) for name in names]
    assert {c.__name__ for c in found} >= {"CacheState", "EnsurePlan", "FetchPolicy",
                                           "PrefillPlan", "TokenRingState", "Rules"}
    assert [c.__name__ for c in found if not issubclass(c, tree.Record)] == []


def test_removed_names_stay_removed_and_the_eviction_record_has_a_short_repr():
    """FAILS if a name the library does not use comes back as public surface (the forwarders
    between an op and its eviction record, ``state.usable_slots``, the test oracle
    ``hybrid.cpu_partial_reference``, ``selection.argmin_among``), or if the state's eviction
    record prints its functions (the dataclass default) instead of ``EvictionPolicy('lru')``."""
    from pallas_cache import evictions, hybrid, reference, selection, state

    gone = {evictions: ("policy_of", "name_of", "cold_state", "history_of", "observe_call",
                        "PER_CALL"),
            state: ("usable_slots",), hybrid: ("cpu_partial_reference",),
            selection: ("argmin_among",), reference.evictions: ("policy_of",)}
    for module, names in gone.items():
        for name in names:
            assert not hasattr(module, name), f"{module.__name__}.{name}"
            assert name not in getattr(module, "__all__", ())
    assert repr(pc.init(1, 2, 2).eviction) == "EvictionPolicy('lru')"
    assert repr(pc.Eviction.ROUTE_KNN.policy) == "EvictionPolicy('route_knn')"
