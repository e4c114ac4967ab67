"""One process of a multi-controller run, launched by `tests/test_multihost.py`.

``python tests/_multihost_worker.py OUT --processes N --process-id I --port P
--devices D [--cases ...]``: with ``N == 1`` one process of ``D`` CPU devices (the
one-process reference, 8 devices); with ``N == 2`` one of two processes of ``D``
devices each, joined by ``jax.distributed.initialize`` on ``127.0.0.1:P`` with gloo
CPU collectives. Both build the same 2 x 4 ``("data", "model")`` mesh over all devices
(in two processes, ``"data"`` runs across them) and run the same cases; process 0
writes ``OUT/results.json`` (checks and compiled-program facts) and
``OUT/arrays.npz`` (the gathered values that the test compares between the runs).
Every process prints one line per finished case: the launcher's stall timer.

The cases: LoRA / QLoRA train steps (FSDP and Megatron, the model and setup of
`benchmarks/bench_sharded.py`), a stacked-layer `lax.scan` QLoRA step, building a
QLoRA model from global arrays (`quantize`, `loraify`, `qax.sharding.from_process_local`),
the entry points that read values, and orbax checkpoints across process counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback


def _args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--cases", default="all")
    parser.add_argument("--restore", default="", help="a checkpoint to restore")
    return parser.parse_args(argv)


def _start(args) -> None:
    """Before JAX starts: the device count, then the multi-controller runtime."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:
    # a line every 2 s while JAX starts (slow on a loaded machine): the launcher's
    # stall timer then measures the cases (a process that cannot join the others
    # fails in `initialize`, after `initialization_timeout`)
    import threading

    started = threading.Event()

    def _starting() -> None:
        while not started.wait(2):
            print(f"[process {ARGS.process_id}] starting", flush=True)

    threading.Thread(target=_starting, daemon=True).start()
    _start(ARGS)
    started.set()
    print(f"[process {ARGS.process_id}] started", flush=True)
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import warnings  # noqa: E402

import bench_sharded as bs  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_lora import MATMUL_WEIGHTS, dense_linear  # noqa: E402
from bench_lora import make_loss as model_loss  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import qax  # noqa: E402
from tests._multihost_model import (  # noqa: E402
    BLOCK,
    CFG,
    TRAIN_CASES,
    checkpoint_tree,
    dense_params,
    params,
)

RESULTS: dict = {}  # what process 0 writes as JSON
ARRAYS: dict = {}  # the gathered arrays it writes


def say(*parts) -> None:
    print(f"[process {jax.process_index()}]", *parts, flush=True)


def gather(tree):
    """Every leaf's whole value on every process (NumPy), implicit arrays kept."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def record(prefix: str, tree) -> None:
    """Keep the gathered leaves of `tree` under ``prefix/<path>``."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(gather(tree))[0]:
        ARRAYS[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)


MESH = None  # the 2 x 4 mesh, made by `main` (after JAX starts)
TOKENS = np.asarray(
    np.random.default_rng(5).integers(0, CFG.vocab, (CFG.batch, CFG.seq + 1)),
    np.int32,
)
_BASE_FIELDS = {"w", "q", "scale", "packed", "absmax"}


def frozen_leaves(tree) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if {getattr(k, "name", None) for k in path} & _BASE_FIELDS:
            out[jax.tree_util.keystr(path)] = leaf
    return out


# ----------------------------------------------------------------------------------------
# Cases


def case_train() -> None:
    """Each (kind, layout): one jitted step; loss, factors, optimizer state, codes."""
    out = {}
    for kind, layout in TRAIN_CASES:
        name = f"{kind}-{layout}"
        setup = bs.build(CFG, params(kind), layout, MESH, TOKENS)["qax"]
        args = setup.placed()
        with qax.materialization_policy(qax.ImplicitBase, "error"):
            program = setup.jitted().lower(*args).compile()
        new, opt_state, loss = program(*args)
        text = program.as_text()
        shapes = bs.base_shapes(params(kind)[1])
        before, after = frozen_leaves(args[0]), frozen_leaves(new)
        out[name] = {
            "collectives": bs.collectives(text),
            "gathered": sorted(
                [dt, list(shape), n]
                for (dt, shape), n in bs.gathered_arrays(text, shapes).items()
            ),
            # the base did not move and kept its sharding (checked on global arrays)
            "frozen_kept": all(after[k].sharding == before[k].sharding for k in before)
            and after.keys() == before.keys(),
            "spans_processes": not jax.tree.leaves(args[0])[0].is_fully_addressable,
            "types": sorted(
                {type(x).__name__ for x in jax.tree.leaves(new, is_leaf=_implicit)}
            ),
        }
        record(f"train/{name}/loss", loss)
        record(f"train/{name}/factors", qax.lora.split(new)[0])
        record(f"train/{name}/opt_state", opt_state)
        record(f"train/{name}/frozen_after", after)
        record(f"train/{name}/frozen_before", before)
        say("train", name)
    RESULTS["train"] = out


def _implicit(x) -> bool:
    return isinstance(x, qax.ImplicitBase)


def case_scan() -> None:
    """Layers stacked for `lax.scan`, every matmul weight LoRA over NF4, FSDP."""
    dense = dense_params(stacked=True)
    rng = np.random.default_rng(2)

    def convert(path, w):
        if getattr(path[-1], "key", None) not in MATMUL_WEIGHTS:
            return w
        lead = w.shape[:-2]
        a = 0.02 * rng.standard_normal((*lead, w.shape[-2], CFG.rank))
        b = 0.02 * rng.standard_normal((*lead, CFG.rank, w.shape[-1]))
        base = qax.quant.NF4Weight.from_array(
            jnp.asarray(w), BLOCK, batch_ndim=len(lead)
        )
        return qax.lora.LoraWeight(base, a.astype(w.dtype), b.astype(w.dtype))

    implicit = jax.tree_util.tree_map_with_path(convert, dense)

    def spec(path, x):
        name = getattr(path[-1], "key", None)
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        if name in MATMUL_WEIGHTS or name == "wte":
            return P(*([None] * stacked), bs.AXES)
        return P()

    shardings = qax.sharding.implicit_shardings(
        implicit, jax.tree_util.tree_map_with_path(spec, dense), MESH
    )
    activations = NamedSharding(MESH, P(bs.AXES, None, None))
    loss = qax.use_implicit_args(
        model_loss(
            CFG,
            dense_linear,
            scan=True,
            layout=lambda x, _: jax.lax.with_sharding_constraint(x, activations),
        )
    )
    step = bs.make_step(loss, *bs.QAX)
    opt_state = bs.OPTIMIZER.init(qax.lora.split(implicit)[0])
    opt_sh = jax.tree.map(lambda _: NamedSharding(MESH, P()), opt_state)
    in_sh = (shardings, opt_sh, NamedSharding(MESH, P(bs.AXES)))
    args = jax.device_put((implicit, opt_state, TOKENS), in_sh)
    program = jax.jit(step, in_shardings=in_sh).lower(*args).compile()
    new, _, value = program(*args)
    stacked = {tuple(x.shape) for x in jax.tree.leaves(implicit["layers"])}
    shapes = stacked | {s[1:] for s in stacked}
    RESULTS["scan"] = {
        "gathered": sorted(
            [dt, list(shape), n]
            for (dt, shape), n in bs.gathered_arrays(program.as_text(), shapes).items()
        ),
        "collectives": bs.collectives(program.as_text()),
    }
    record("scan/loss", value)
    record("scan/factors", qax.lora.split(new)[0])
    say("scan")


def _global(host: np.ndarray, sharding) -> jax.Array:
    """A global array from a host array every process holds (each takes its shards)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def case_build() -> None:
    """QLoRA built from global FSDP-sharded weights: each process quantizes its rows."""
    dense = dense_params(seed=3)
    specs, _ = bs.dense_specs(dense, "fsdp")
    placed = jax.tree.map(
        lambda x, s: _global(np.asarray(x), NamedSharding(MESH, s)), dense, specs
    )
    pick = lambda path, _: path.rsplit("/", 1)[-1] in MATMUL_WEIGHTS  # noqa: E731
    everything = lambda *_: True  # noqa: E731
    out = {}
    for fmt, options in (("nf4", {"block_size": BLOCK}), ("int8", {})):
        quantized = qax.quant.quantize(placed, fmt, filter=pick, **options)
        w1 = quantized["layers"][0]["mlp"]["w1"]
        # the program that quantizes a global weight moves nothing between devices
        text = (
            jax.jit(
                lambda w, fmt=fmt, options=options: qax.quant.quantize(
                    w, fmt, filter=everything, **options
                )
            )
            .lower(placed["layers"][0]["mlp"]["w1"])
            .compile()
            .as_text()
        )
        lora = qax.lora.loraify(quantized, CFG.rank, key=jax.random.key(7), filter=pick)
        l1 = lora["layers"][0]["mlp"]["w1"]
        out[fmt] = {
            "type": type(w1).__name__,
            "leaf_specs": [str(x.sharding.spec) for x in jax.tree.leaves(w1)],
            "local_rows": [
                x.addressable_shards[0].data.shape[0] for x in jax.tree.leaves(w1)
            ],
            "fully_addressable": [x.is_fully_addressable for x in jax.tree.leaves(w1)],
            "quantize_collectives": bs.collectives(text),
            "factor_specs": [str(l1.a.sharding.spec), str(l1.b.sharding.spec)],
            "factor_mesh": l1.a.sharding.mesh.shape == MESH.shape,
        }
        record(f"build/{fmt}/params", lora)
        if fmt == "nf4":  # a step of LoRA over the global base, factors from loraify
            setup = bs.build(CFG, (dense, lora), "fsdp", MESH, TOKENS)["qax"]
            tree, opt_state, tokens = setup.args  # the parameters as built
            rest = jax.device_put((opt_state, tokens), setup.in_shardings[1:])
            new, _, loss = setup.jitted()(tree, *rest)
            record(f"build/{fmt}/loss", loss)
            record(f"build/{fmt}/factors", qax.lora.split(new)[0])

    # from_process_local: each process passes only its rows of the codes and scales
    host = qax.quant.NF4Weight.from_array(jnp.asarray(dense["head"]), BLOCK)
    like = jax.eval_shape(lambda: host)
    shardings = qax.sharding.implicit_shardings(like, P(bs.AXES), MESH)
    n, i = jax.process_count(), jax.process_index()
    local = [
        np.asarray(leaf)[i * leaf.shape[0] // n : (i + 1) * leaf.shape[0] // n]
        for leaf in jax.tree.leaves(host)
    ]
    built = qax.sharding.from_process_local(like, local, shardings)
    same = gather(built)
    out["from_process_local"] = {
        "type": type(built).__name__,
        "equal": all(
            np.array_equal(np.asarray(g), np.asarray(w))
            for g, w in zip(jax.tree.leaves(same), jax.tree.leaves(host), strict=True)
        ),
        "shape": list(built.shape),
        "specs": [str(x.sharding.spec) for x in jax.tree.leaves(built)],
    }
    RESULTS["build"] = out
    say("build")


def _attempt(name: str, fn, results: dict) -> None:
    try:
        got = fn()
        results[name] = {"ok": True, "got": got}
    except Exception as error:  # noqa: BLE001 (the test reads what was raised)
        results[name] = {
            "ok": False,
            "error": type(error).__name__,
            "message": str(error),
        }
    say("entry point", name, "ok" if results[name]["ok"] else "raised")


def case_entry_points() -> None:
    """Each entry point that reads values, on a QLoRA weight whose rows are split over
    the processes (each holds half of the data)."""
    rng = np.random.default_rng(4)
    full = rng.standard_normal((64, 32)).astype(np.float32)
    w = _global(full, NamedSharding(MESH, P(bs.AXES)))
    x = rng.standard_normal((8, 64)).astype(np.float32)
    res: dict = {}

    def f(p, x):
        return jnp.sum(jnp.tanh(x @ p))

    q = qax.quant.quantize({"w": w}, "nf4", filter=lambda *_: True, block_size=BLOCK)
    q = q["w"]
    lora = qax.lora.loraify({"w": q}, 2, key=jax.random.key(0), filter=lambda *_: True)
    lora = lora["w"]
    ref = float(np.sum(np.tanh(x @ np.asarray(gather(q).materialize()))))
    _attempt("shape", lambda: [list(lora.shape), str(lora.dtype)], res)
    _attempt("repr", lambda: type(repr(lora)).__name__, res)
    _attempt("nbytes", lambda: q.nbytes, res)
    _attempt(
        "LoraWeight",
        lambda: list(qax.lora.LoraWeight(w, lora.a, lora.b).shape),
        res,
    )

    def value(y):
        return float(gather(y)) if not isinstance(y, float) else y

    _attempt(
        "materialize",
        lambda: bool(np.allclose(gather(q.materialize()), gather(q).materialize())),
        res,
    )
    _attempt(
        "jnp.asarray",
        lambda: bool(np.allclose(gather(jnp.asarray(q)), gather(q).materialize())),
        res,
    )
    _attempt("np.asarray", lambda: np.asarray(q).shape, res)
    _attempt("float", lambda: float(lora[0, 0]), res)
    _attempt("jax.device_get", lambda: type(jax.device_get(q)).__name__, res)
    _attempt(
        "use_implicit_args",
        lambda: abs(value(qax.use_implicit_args(f)(lora, x)) - ref) < 1e-4,
        res,
    )
    _attempt(
        "jit",
        lambda: abs(value(jax.jit(qax.use_implicit_args(f))(lora, x)) - ref) < 1e-4,
        res,
    )

    def policy():
        with qax.materialization_policy(qax.ImplicitBase, "error"):
            return abs(value(jax.jit(qax.use_implicit_args(f))(lora, x)) - ref) < 1e-4

    _attempt("materialization_policy", policy, res)

    def audit():
        with qax.materialization_audit() as seen:
            jax.jit(qax.use_implicit_args(lambda p: jnp.sin(p)))(q)
        return [r.primitive for r in seen.records]

    _attempt("materialization_audit", audit, res)
    _attempt("explain", lambda: "runs" in str(qax.explain("dot_general", x, lora)), res)
    _attempt("merge", lambda: type(qax.lora.merge({"w": lora})["w"]).__name__, res)
    _attempt("trainable_count", lambda: qax.lora.trainable_count({"w": lora}), res)
    _attempt(
        "split/combine",
        lambda: type(qax.lora.combine(*qax.lora.split({"w": lora}))["w"]).__name__,
        res,
    )
    _attempt(
        "materialize_nested",
        lambda: list(qax.materialize_nested({"w": lora})["w"].shape),
        res,
    )
    _attempt(
        "describe", lambda: len(qax.checkpoint.describe({"w": lora})["implicit"]), res
    )
    _attempt("dense_spec", lambda: str(qax.sharding.dense_spec(lora)), res)
    _attempt(
        "process_allgather then np.asarray",
        lambda: bool(np.allclose(np.asarray(gather(q)), gather(q).materialize())),
        res,
    )
    RESULTS["entry_points"] = res


def case_checkpoint() -> None:
    """Save this run's tree; restore the other run's checkpoint onto this mesh."""
    import orbax.checkpoint as ocp

    tree, shardings = checkpoint_tree(MESH)
    placed = jax.device_put(tree, shardings)
    path = pathlib.Path(ARGS.out) / "checkpoint"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(
            path, placed, custom_metadata={"qax": qax.checkpoint.describe(placed)}
        )
        ckpt.wait_until_finished()
    if jax.process_index() == 0:
        (pathlib.Path(ARGS.out) / "checkpoint.done").touch()
    out = {"saved": str(path)}
    if ARGS.restore:  # the other run's, saved by then or soon (it runs alongside)
        done = pathlib.Path(ARGS.restore).parent / "checkpoint.done"
        start = time.monotonic()
        while not done.exists():
            if time.monotonic() - start > 300:
                raise TimeoutError(f"no checkpoint at {ARGS.restore} after 300 s")
            say("waiting for", ARGS.restore)
            time.sleep(1)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            tree,
            shardings,
        )
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(ARGS.restore, target)
            description = ckpt.metadata(ARGS.restore).custom_metadata["qax"]
        # (a template-less restore across process counts is refused by orbax:
        # "Topology mismatch"; the description saved beside it still reads back)
        pairs = zip(jax.tree.leaves(restored), jax.tree.leaves(placed), strict=True)
        got, want = gather(restored), tree
        out["restored"] = {
            "structure": jax.tree.structure(restored) == jax.tree.structure(tree),
            "shardings": all(g.sharding == w.sharding for g, w in pairs),
            "equal": all(
                np.array_equal(np.asarray(g), np.asarray(w))
                for g, w in zip(
                    jax.tree.leaves(got), jax.tree.leaves(want), strict=True
                )
            ),
            "w1_types": [
                type(restored["int8"]["w1"]).__name__,
                type(restored["int8"]["w1"].w).__name__,
                type(restored["nf4"]["w1"].w).__name__,
            ],
            "description": description == qax.checkpoint.describe(placed),
        }
    RESULTS["checkpoint"] = out
    say("checkpoint")


def case_hang() -> None:
    """Process 1 never joins the collective that process 0 waits in (the launcher's
    stall timeout must end the run)."""
    if jax.process_index() == 1:
        say("not joining")
        time.sleep(600)
    say("waiting in a collective")
    multihost_utils.sync_global_devices("never")


CASES = {
    "train": case_train,
    "scan": case_scan,
    "build": case_build,
    "entry_points": case_entry_points,
    "checkpoint": case_checkpoint,
    "hang": case_hang,
}


def main() -> None:
    global MESH
    MESH = bs.make_mesh()
    RESULTS.update(
        processes=jax.process_count(),
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        jax=jax.__version__,
    )
    warnings.simplefilter("ignore")
    names = (
        [c for c in CASES if c != "hang"]
        if ARGS.cases == "all"
        else ARGS.cases.split(",")
    )
    timings = {}
    for name in names:
        start = time.perf_counter()
        try:
            CASES[name]()
        except Exception:
            traceback.print_exc()
            raise
        timings[name] = round(time.perf_counter() - start, 2)
        say(name, "took", timings[name], "s")
    RESULTS["seconds"] = timings
    if jax.process_index() == 0:
        out = pathlib.Path(ARGS.out)
        np.savez(out / "arrays.npz", **ARRAYS)
        (out / "results.json").write_text(json.dumps(RESULTS, default=str))
    say("done")


if __name__ == "__main__":
    main()
