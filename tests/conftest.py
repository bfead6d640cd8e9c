"""pytest's view of the shared test helpers (:mod:`tests.harness`): the Hypothesis profile, the
markers and adapter parametrisation hooks, and the fixtures. Test files import helpers from
``tests.harness``, never from here."""

from tests.harness import (_release_compiled_programs, adapter, optimized_xla,  # noqa: F401
                           pytest_configure, pytest_generate_tests)
