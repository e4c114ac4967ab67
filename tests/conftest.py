"""Strict harness: tracer-leak checking on, unexpected materialization is an error.

`JAX_CHECK_TRACER_LEAKS=0` runs the suite without leak checking: eager calls then share
one trace per thread, as they do in users' programs.
"""

import os

os.environ.setdefault("JAX_CHECK_TRACER_LEAKS", "1")

import jax  # noqa: E402

jax.config.update(
    "jax_check_tracer_leaks", os.environ["JAX_CHECK_TRACER_LEAKS"] not in ("0", "")
)
