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

What leak checking costs is mostly garbage collection: when a finished trace is still
alive (JAX's own closures make cycles, e.g. every `custom_jvp` call such as
`jax.nn.gelu` in a staged program), JAX runs a full `gc.collect()` before it looks for
tracers, and a full collection walks every object of the process: tenths of a second
each in a worker that has compiled a thousand programs. So every test starts with the
objects that are alive before it frozen (`gc.freeze()`: moved out of the collector's
sight, never freed while frozen) and each module ends by unfreezing and collecting them. A
cycle made during a test is still collected, and a trace reachable from anything,
frozen or not, is still found: only the price of each check changes.

JAX 0.10 also bypasses its caches keyed by the trace context while leak checking (its
`util.cache`; among them the compiled program of every eager primitive, so each eager
`lax.add` compiled anew); JAX 0.11 stopped doing so. The harness keeps those caches on
under 0.10 too (`_jax_caches_kept_under_leak_checks`), so both legs check leaks at
the same price. The checks themselves are unchanged.
"""

import gc
import inspect
import os
import types

import pytest

os.environ.setdefault("JAX_CHECK_TRACER_LEAKS", "1")
LEAK_CHECKS = os.environ["JAX_CHECK_TRACER_LEAKS"] not in ("0", "")

import jax  # noqa: E402

jax.config.update("jax_check_tracer_leaks", LEAK_CHECKS)


def _jax_caches_kept_under_leak_checks():
    """Under JAX 0.10, let `jax._src.util.cache` see leak checking as off (see above)."""
    from jax._src import util

    if "check_tracer_leaks" not in inspect.getsource(util.cache):
        return  # JAX 0.11 and later keep their caches under leak checking
    config = util.config

    class _ConfigForCaches:
        check_tracer_leaks = types.SimpleNamespace(value=False)

        def __getattr__(self, name):
            return getattr(config, name)

    util.config = _ConfigForCaches()


_jax_caches_kept_under_leak_checks()


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
            gc.unfreeze()
            gc.collect()


@pytest.fixture(autouse=True)
def _older_objects_frozen(_leak_checking):
    """Older objects out of the collector's sight for this test (see the module doc).

    The collection first frees the cycles the previous test left (it walks only the
    objects made since the last freeze), so what is frozen is what is still alive."""
    gc.collect()
    gc.freeze()
    yield
