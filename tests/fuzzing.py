"""Shared hypothesis settings for the generated tests.

``NSA_NUMBA_FUZZ=ci`` (the default) replays a fixed, derandomized set of cases, so a
test run is reproducible: 50 per test, and twice as many other ones in the tests
marked ``extended``, which CI runs (``pytest -m extended``); together they are the
150 cases per generator the suite always replayed. ``NSA_NUMBA_FUZZ=explore`` draws
new random cases, many more of them. ``NSA_NUMBA_FUZZ_EXAMPLES`` sets how many per
(unmarked) test in either profile.
"""

import os

from hypothesis import HealthCheck, settings

_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _examples(default):
    return int(os.environ.get("NSA_NUMBA_FUZZ_EXAMPLES", default))


#: cases per extended test (``pytest -m extended``)
EXTENDED_EXAMPLES = 2 * _examples(50)

settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          max_examples=_examples(50), suppress_health_check=_CHECKS,
                          print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=_examples(2000),
                          suppress_health_check=_CHECKS, print_blob=True)
settings.load_profile(os.environ.get("NSA_NUMBA_FUZZ", "ci"))
