"""Shared hypothesis settings for the generated tests.

``NSA_NUMBA_FUZZ=ci`` (the default) replays a fixed, derandomized set of cases, so a
test run is reproducible; ``NSA_NUMBA_FUZZ=explore`` draws new random cases, many more
of them (``NSA_NUMBA_FUZZ_EXAMPLES`` sets how many per test in either profile).
"""

import os

from hypothesis import HealthCheck, settings

_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _examples(default):
    return int(os.environ.get("NSA_NUMBA_FUZZ_EXAMPLES", default))


settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          max_examples=_examples(150), suppress_health_check=_CHECKS,
                          print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=_examples(2000),
                          suppress_health_check=_CHECKS, print_blob=True)
settings.load_profile(os.environ.get("NSA_NUMBA_FUZZ", "ci"))
