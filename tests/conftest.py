"""Strict harness: tracer-leak checking on, unexpected materialization is an error.

Leak checking (``jax_check_tracer_leaks``) is on for every module that does not opt
out with ``pytestmark = pytest.mark.no_leak_check``. It finds tracers that qax's
interpreter lets escape, but JAX turns some of its caches off under it: the suite takes
about twice as long. The modules that test qax's tracing machinery keep it (the core,
every transformation and control-flow primitive, the built-in types' handlers, the
property tests, sharding); the ones that run whole models, notebooks and documentation
pages through that same machinery opt out (their subprocesses too).
`JAX_CHECK_TRACER_LEAKS=0` runs the whole suite without it: eager calls then share one
trace per thread, as they do in users' programs.
"""

import os

import pytest

os.environ.setdefault("JAX_CHECK_TRACER_LEAKS", "1")
LEAK_CHECKS = os.environ["JAX_CHECK_TRACER_LEAKS"] not in ("0", "")

import jax  # noqa: E402

jax.config.update("jax_check_tracer_leaks", LEAK_CHECKS)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "no_leak_check: run the module (and its subprocesses) without "
        "jax_check_tracer_leaks (see tests/conftest.py)",
    )


@pytest.fixture(autouse=True, scope="module")
def _leak_checking(request):
    """Leak checking as the module asks (on, unless marked ``no_leak_check``)."""
    wanted = LEAK_CHECKS and request.node.get_closest_marker("no_leak_check") is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_CHECK_TRACER_LEAKS", "1" if wanted else "0")
        jax.config.update("jax_check_tracer_leaks", wanted)
        try:
            yield
        finally:
            jax.config.update("jax_check_tracer_leaks", LEAK_CHECKS)
