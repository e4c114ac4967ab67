"""`qax.materialization_audit` and `qax.materialization_policy`."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from tests.helpers import PlainMatmulLora, QuietLora, TransposableLora, make_lora

KEYS = jax.random.split(jax.random.PRNGKey(0), 4)
X = jax.random.normal(KEYS[0], (3, 5))


def line_of(fn, marker: str) -> str:
    """``file:line (function)`` of the line of `fn` that contains `marker`."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, text in enumerate(lines) if marker in text)
    return f"{inspect.getsourcefile(fn)}:{start + offset} ({fn.__name__})"


def model(x, w1, w2):
    h = jnp.tanh(x @ w1)
    return h @ w2.T  # w2.T: the only primitive PlainMatmulLora has no handler for


def lora_params(cls=PlainMatmulLora):
    return make_lora(KEYS[1], 5, 7, cls=cls), make_lora(KEYS[2], 4, 7, cls=cls)


def dense_model(x, w1, w2):
    return model(x, w1.materialize(), w2.materialize())


RUNNERS = {
    "eager": lambda f: qax.use_implicit_args(f),
    "jit": lambda f: jax.jit(qax.use_implicit_args(f)),
}


@pytest.mark.parametrize("runner", RUNNERS.values(), ids=RUNNERS.keys())
def test_audit_lists_exactly_the_unhandled_materialization(runner):
    w1, w2 = lora_params()
    with qax.materialization_policy(PlainMatmulLora, "allow"):
        with qax.materialization_audit() as audit:
            out = runner(model)(X, w1, w2)

    np.testing.assert_allclose(out, dense_model(X, w1, w2), rtol=1e-5, atol=1e-5)
    assert len(audit) == 1, audit
    (record,) = audit
    assert record.primitive == "transpose"
    assert record.cls is PlainMatmulLora
    assert record.shape == (4, 7) and record.dtype == np.float32
    assert record.nbytes == 4 * 7 * 4
    assert record.source == line_of(model, "w2.T")
    assert record.phase == "forward"
    assert record.policy == "allow"
    assert audit.total_bytes == 112


@pytest.mark.parametrize("runner", RUNNERS.values(), ids=RUNNERS.keys())
def test_error_policy_names_primitive_class_and_line(runner):
    w1, w2 = lora_params()
    with qax.materialization_policy(PlainMatmulLora, "error"):
        with qax.materialization_audit() as audit:
            with pytest.raises(qax.MaterializationError) as info:
                runner(model)(X, w1, w2)

    error = info.value
    assert error.primitive == "transpose" and error.cls is PlainMatmulLora
    assert error.source == line_of(model, "w2.T")
    message = str(error)
    for part in ("transpose", "PlainMatmulLora", error.source, "float32[4, 7]"):
        assert part in message
    assert 'qax.materialization_policy(PlainMatmulLora, "error")' in message
    # The audit saw it before it raised.
    assert [r.policy for r in audit] == ["error"]


@pytest.mark.parametrize("runner", RUNNERS.values(), ids=RUNNERS.keys())
def test_audit_is_empty_when_every_primitive_is_handled(runner):
    w1, w2 = lora_params(TransposableLora)
    with qax.materialization_policy(qax.ImplicitArray, "error"):
        with qax.materialization_audit() as audit:
            out = runner(model)(X, w1, w2)
    np.testing.assert_allclose(out, dense_model(X, w1, w2), rtol=1e-5, atol=1e-5)
    assert len(audit) == 0 and not audit
    assert str(audit) == "Materialization audit: nothing was materialized."


def loss(x, w):
    y = x @ w  # handled forward; its transpose, ct @ w.T, is not: backward
    return jnp.sum(jnp.tanh(y)) + jnp.sum(w)  # sum(w): forward only


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_and_backward_attribution_of_grad(jit):
    w = make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora)
    grad_x = qax.use_implicit_args(jax.grad(loss))
    if jit:
        grad_x = jax.jit(grad_x)
    with qax.materialization_policy(PlainMatmulLora, "allow"):
        with qax.materialization_audit() as audit:
            got = grad_x(X, w)

    np.testing.assert_allclose(
        got, jax.grad(loss)(X, w.materialize()), rtol=1e-4, atol=1e-6
    )
    assert [(r.primitive, r.phase) for r in audit] == [
        ("reduce_sum", "forward"),
        ("dot_general", "backward"),
    ]
    assert audit[0].source == line_of(loss, "jnp.sum(w)")
    # A backward materialization points at the forward operation it transposes.
    assert audit[1].source == line_of(loss, "y = x @ w")
    assert audit.filter(phase="backward") == [audit[1]]
    assert "backward" in str(audit)


def test_grad_outside_materializes_in_the_forward_pass_only():
    w = make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora)
    with qax.materialization_policy(PlainMatmulLora, "allow"):
        with qax.materialization_audit() as audit:
            jax.grad(qax.use_implicit_args(loss), argnums=(0, 1))(X, w)
    assert [(r.primitive, r.phase) for r in audit] == [("reduce_sum", "forward")]


@jax.jit
def project(x, w):
    return x @ w.T


def test_cached_jit_body_reports_again_and_obeys_later_policies():
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    f = qax.use_implicit_args(project)
    with qax.materialization_policy(PlainMatmulLora, "allow"):
        with qax.materialization_audit() as audit:
            f(X, w)
            f(X, w)  # the re-traced body of `project` is reused: its event is replayed
    assert [r.primitive for r in audit] == ["transpose", "transpose"]
    with qax.materialization_policy(PlainMatmulLora, "error"):
        with pytest.raises(qax.MaterializationError, match="transpose"):
            f(X, w)


def test_audit_as_data_and_table():
    w1, w2 = lora_params()
    with qax.materialization_policy(PlainMatmulLora, "allow"):
        with qax.materialization_audit() as audit:
            qax.use_implicit_args(model)(X, w1, w2)
            qax.use_implicit_args(lambda w: jnp.sum(w))(w1)
    assert len(audit.filter(primitive="transpose")) == 1
    assert len(audit.filter(cls=qax.ImplicitArray)) == 2
    assert audit.filter(phase="backward") == []
    rows = audit.as_dicts()
    assert rows[1] == {
        "primitive": "reduce_sum",
        "cls": "PlainMatmulLora",
        "shape": (5, 7),
        "dtype": "float32",
        "nbytes": 140,
        "source": rows[1]["source"],
        "phase": "forward",
        "policy": "allow",
    }
    table = str(audit)
    assert table.splitlines()[0] == (
        "Materialization audit: 2 materializations, 252 bytes"
    )
    header = table.splitlines()[1].split()
    assert header == [
        "#",
        "pass",
        "primitive",
        "class",
        "array",
        "bytes",
        "policy",
        "source",
    ]
    assert "float32[4, 7]" in table and "test_audit.py:" in table
    assert repr(audit) == table


def test_nested_audits_both_record_and_outside_nothing_is_recorded():
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    f = qax.use_implicit_args(lambda w: jnp.sum(w))
    with qax.materialization_policy(PlainMatmulLora, "allow"):
        with qax.materialization_audit() as outer:
            f(w)
            with qax.materialization_audit() as inner:
                f(w)
        f(w)
    assert (len(outer), len(inner)) == (2, 1)


# ----------------------------------------------------------------------------------------
# Policies


def run_sum(w):
    return qax.use_implicit_args(lambda w: jnp.sum(w))(w)


def test_default_policy_warns_and_allow_is_silent_but_recorded():
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    with pytest.warns(qax.MaterializationWarning, match="reduce_sum"):
        run_sum(w)
    with qax.materialization_policy("reduce_sum", "allow"):
        with qax.materialization_audit() as audit:
            run_sum(w)  # the strict harness turns a warning into a failure
    assert [r.policy for r in audit] == ["allow"]


@pytest.mark.parametrize(
    "outer, inner, expected",
    [
        ((PlainMatmulLora, "error"), ("reduce_sum", "allow"), "allow"),
        (("reduce_sum", "allow"), (PlainMatmulLora, "error"), "error"),
        ((qax.ImplicitArray, "allow"), (PlainMatmulLora, "warn"), "warn"),
        ((PlainMatmulLora, "allow"), (qax.ImplicitArray, "error"), "error"),
    ],
    ids=[
        "primitive-inside-class",
        "class-inside-primitive",
        "sub-inside",
        "base-inside",
    ],
)
def test_innermost_block_wins(outer, inner, expected):
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    with qax.materialization_policy(*outer), qax.materialization_policy(*inner):
        with qax.materialization_audit() as audit:
            if expected == "error":
                with pytest.raises(qax.MaterializationError):
                    run_sum(w)
            elif expected == "warn":
                with pytest.warns(qax.MaterializationWarning):
                    run_sum(w)
            else:
                run_sum(w)
    assert [r.policy for r in audit] == [expected]


@pytest.fixture
def global_rules():
    """Set global rules in a test; they are undone afterwards."""
    rules = []
    yield lambda target, policy: rules.append(
        qax.materialization_policy(target, policy)
    )
    for rule in reversed(rules):
        rule.undo()


@pytest.mark.parametrize(
    "rules, expected",
    [
        ([(PlainMatmulLora, "error"), ("reduce_sum", "allow")], "allow"),
        ([("reduce_sum", "allow"), (PlainMatmulLora, "error")], "allow"),
        ([(qax.ImplicitArray, "error"), (PlainMatmulLora, "allow")], "allow"),
        ([(PlainMatmulLora, "allow"), (qax.ImplicitArray, "error")], "allow"),
        ([(PlainMatmulLora, "allow"), (PlainMatmulLora, "error")], "error"),
    ],
    ids=[
        "primitive-beats-class",
        "primitive-beats-class-2",
        "subclass-beats-base",
        "subclass-beats-base-2",
        "last-call-replaces",
    ],
)
def test_global_rules_most_specific_wins(global_rules, rules, expected):
    for target, policy in rules:
        global_rules(target, policy)
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    if expected == "error":
        with pytest.raises(qax.MaterializationError):
            run_sum(w)
    else:
        run_sum(w)


def test_block_beats_global_and_global_persists(global_rules):
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    global_rules(PlainMatmulLora, "error")
    with qax.materialization_policy("reduce_sum", "allow"):
        run_sum(w)
    with pytest.raises(
        qax.MaterializationError, match="set by qax.materialization_policy"
    ):
        run_sum(w)


def test_with_block_sets_no_global_rule_and_undo_restores():
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    with qax.materialization_policy(PlainMatmulLora, "error"):
        pass
    with pytest.warns(qax.MaterializationWarning):
        run_sum(w)
    first = qax.materialization_policy(PlainMatmulLora, "allow")
    second = qax.materialization_policy(PlainMatmulLora, "error")
    try:
        with pytest.raises(qax.MaterializationError):
            run_sum(w)
        second.undo()
        run_sum(w)  # back to "allow"
    finally:
        second.undo()
        first.undo()
    with pytest.warns(qax.MaterializationWarning):
        run_sum(w)


def test_explicit_policy_beats_warn_on_materialize_keyword():
    quiet = make_lora(KEYS[1], 4, 5, cls=QuietLora)
    with qax.materialization_audit() as audit:
        run_sum(quiet)  # the keyword alone: "allow"
    assert [r.policy for r in audit] == ["allow"]
    with qax.materialization_policy(QuietLora, "warn"):
        with pytest.warns(qax.MaterializationWarning):
            run_sum(quiet)
    with qax.materialization_policy("reduce_sum", "error"):
        with pytest.raises(qax.MaterializationError, match="QuietLora"):
            run_sum(quiet)


def test_error_in_backward_pass_says_so():
    w = make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora)
    with qax.materialization_policy("dot_general", "error"):
        with pytest.raises(qax.MaterializationError, match="backward pass") as info:
            qax.use_implicit_args(jax.grad(lambda x, w: jnp.sum(x @ w)))(X, w)
    assert info.value.phase == "backward"


@pytest.mark.parametrize(
    "target, policy, error, match",
    [
        (
            PlainMatmulLora,
            "ignore",
            ValueError,
            "Unknown materialization policy 'ignore'",
        ),
        (3, "error", TypeError, "must be an implicit array class"),
        (jnp.ndarray, "error", TypeError, "must be an implicit array class"),
        ("dot_genral", "error", ValueError, "Did you mean 'dot_general'"),
    ],
    ids=["bad-policy", "int-target", "non-implicit-class", "misspelt-primitive"],
)
def test_bad_arguments(target, policy, error, match):
    with pytest.raises(error, match=match):
        qax.materialization_policy(target, policy)


def test_primitive_object_target_and_repr():
    rule = qax.materialization_policy(jax.lax.reduce_sum_p, "allow")
    try:
        assert repr(rule) == "materialization_policy('reduce_sum', 'allow')"
        run_sum(make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora))
    finally:
        rule.undo()


def test_audit_records_materialization_without_warning_filters_interfering():
    w = make_lora(KEYS[1], 4, 5, cls=PlainMatmulLora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with qax.materialization_audit() as audit:
            run_sum(w)
    assert [r.policy for r in audit] == ["warn"]


class Unhandled(qax.ImplicitArray):
    """An implicit array with no handlers: any primitive materializes it."""

    x: qax.ArrayValue

    def materialize(self):
        return self.x


def test_source_skips_installed_libraries_and_names_the_users_line():
    # Flax lives in site-packages: the source must be the user's line that called the
    # layer, not `flax/linen/linear.py` where the unhandled `dot_general` is bound.
    nn = pytest.importorskip("flax.linen")
    kernel = Unhandled(jax.random.normal(KEYS[1], (5, 7)))

    def flax_model(params, x):
        return nn.Dense(7).apply(params, x)  # the user's line

    params = {"params": {"kernel": kernel, "bias": jnp.zeros(7)}}
    with qax.materialization_policy(Unhandled, "allow"):
        with qax.materialization_audit() as audit:
            qax.use_implicit_args(flax_model)(params, X)
    assert [r.primitive for r in audit] == ["dot_general"], audit
    assert audit[0].source == line_of(flax_model, "the user's line")


def test_source_skips_any_site_packages_directory(tmp_path, monkeypatch):
    # A virtualenv keeps site-packages outside the standard library's directory: a
    # library installed there is not the user's code either.
    package = tmp_path / "venv" / "lib" / "site-packages" / "fakelib_qax_audit"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "def layer(w, x):\n    return x @ w  # library line\n"
    )
    monkeypatch.syspath_prepend(str(package.parent))
    import fakelib_qax_audit

    kernel = Unhandled(jax.random.normal(KEYS[1], (5, 7)))

    def user_model(w, x):
        return fakelib_qax_audit.layer(w, x)  # the user's line

    with qax.materialization_policy(Unhandled, "allow"):
        with qax.materialization_audit() as audit:
            qax.use_implicit_args(user_model)(kernel, X)
    assert [r.primitive for r in audit] == ["dot_general"], audit
    assert audit[0].source == line_of(user_model, "the user's line")
