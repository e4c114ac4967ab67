"""`qax.materialization_audit` and `qax.materialization_policy`."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax import _report
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
        "weight": rows[1]["weight"],
        "caller": rows[1]["caller"],
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


def test_source_is_the_layers_line_in_an_installed_library_and_names_the_weight():
    # Flax lives in site-packages: the source is the model's own line (the innermost
    # frame outside qax and JAX: `flax/linen/linear.py`, where the unhandled
    # `dot_general` is bound), the user's line that reached it is `caller`, and the
    # weight is named by its path among the arguments (issue 36, 1).
    nn = pytest.importorskip("flax.linen")

    def flax_model(params, x):
        features = params["params"]["kernel"].shape[1]
        return nn.Dense(features).apply(params, x)  # the user's line

    def with_kernel(n):
        kernel = Unhandled(jax.random.normal(KEYS[1], (5, n)))
        return {"params": {"kernel": kernel, "bias": jnp.zeros(n)}}

    params = with_kernel(7)
    for run in (qax.use_implicit_args, lambda f: jax.jit(qax.use_implicit_args(f))):
        with qax.materialization_policy(Unhandled, "allow"):
            with qax.materialization_audit() as audit:
                run(flax_model)(params, X)
        assert [r.primitive for r in audit] == ["dot_general"], audit
        (record,) = audit
        assert record.source.startswith(inspect.getsourcefile(nn.Dense)), record
        assert record.caller == line_of(flax_model, "the user's line")
        assert record.weight == "params/kernel of argument 0"
    # Shapes of their own for the warning and the error: a call that reuses the body
    # traced above reports without the weight (the body names the first call's).
    params = with_kernel(8)
    with pytest.warns(qax.MaterializationWarning) as warned:
        qax.use_implicit_args(flax_model)(params, X)
    (warning,) = warned
    assert warning.filename == inspect.getsourcefile(nn.Dense)  # points at the layer
    message = str(warning.message)
    assert "params/kernel of argument 0" in message, message
    assert line_of(flax_model, "the user's line") in message, message
    params = with_kernel(9)
    with qax.materialization_policy(Unhandled, "error"):
        with pytest.raises(qax.MaterializationError) as info:
            qax.use_implicit_args(flax_model)(params, X)
    error = str(info.value)
    for part in ("params/kernel of argument 0", "linear.py", "(flax_model)"):
        assert part in error, error


def _fake_library(root, name):
    """A library installed in a site-packages directory under `root`."""
    package = root / "lib" / "site-packages" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "def layer(w, x):\n    return x @ w  # library line\n"
    )
    return package


@pytest.mark.parametrize("layout", ["virtualenv", "python-in-usr-local"])
def test_source_is_the_models_line_in_any_site_packages(tmp_path, monkeypatch, layout):
    # A virtualenv keeps site-packages outside the standard library's directory; a
    # Python built into /usr/local keeps it inside: either way the library's line is
    # the model's line, not the standard library's (skipped) or the user's.
    name = f"fakelib_qax_audit_{layout.replace('-', '_')}"
    package = _fake_library(tmp_path / "venv", name)
    if layout == "python-in-usr-local":
        monkeypatch.setattr(
            _report, "_STDLIB_DIR", str(tmp_path / "venv" / "lib") + "/"
        )
    monkeypatch.syspath_prepend(str(package.parent))
    library = __import__(name)

    # A shape of its own: a body that qax traced before for the same shapes would be
    # reused, and its report does not name the weight (it was another call's).
    kernel = Unhandled(jax.random.normal(KEYS[1], (5, 11 + len(layout))))

    def user_model(params, x):
        return library.layer(params["blocks"][1], x)  # the user's line

    params = {"blocks": [jnp.zeros((5, 7)), kernel]}
    with qax.materialization_policy(Unhandled, "allow"):
        with qax.materialization_audit() as audit:
            qax.use_implicit_args(user_model)(params, X)
    assert [r.primitive for r in audit] == ["dot_general"], audit
    assert audit[0].source == f"{package / '__init__.py'}:2 (layer)"
    assert audit[0].caller == line_of(user_model, "the user's line")
    assert audit[0].weight == "blocks/1 of argument 0"


def test_a_value_computed_inside_or_replayed_is_not_named():
    # Only a value that is one of the arguments is named: not one computed inside,
    # and not the events of a body traced for other arguments and reused (it would
    # name the weight of the first call).
    a = Unhandled(jax.random.normal(KEYS[1], (5, 3)))  # shapes seen nowhere else
    b = Unhandled(jax.random.normal(KEYS[2], (5, 3)))

    def f(params, x):
        return x @ next(iter(params.values()))  # the user's line

    def g(w, x):
        return x @ Unhandled(w)

    records = []
    with qax.materialization_policy(Unhandled, "allow"):
        for params in ({"first": a}, {"second": b}, {"third": a}):
            with qax.materialization_audit() as audit:
                qax.use_implicit_args(f)(params, X)
            (key,) = params
            assert [r.weight for r in audit] in ([f"{key} of argument 0"], [None])
            records += list(audit)
        with qax.materialization_audit() as inside:
            qax.use_implicit_args(g)(jnp.ones((5, 3)), X)
    assert len(records) == 3 and records[0].weight == "first of argument 0"
    assert all(r.source == line_of(f, "the user's line") for r in records)
    assert all(r.caller is None for r in records)  # the user's line is the source
    assert [r.weight for r in inside] == [None] * len(inside) and len(inside) >= 1
