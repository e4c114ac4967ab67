"""Strict harness: tracer-leak checking on, unexpected materialization is an error."""

import os

os.environ.setdefault("JAX_CHECK_TRACER_LEAKS", "1")

import jax  # noqa: E402

jax.config.update("jax_check_tracer_leaks", True)
