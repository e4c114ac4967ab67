"""Profile where tracing time goes: `jax.make_jaxpr` of the LoRA train step, qax vs hand.

Runs `cProfile` over repeated `make_jaxpr` calls of the train step of `bench_lora.py`
(Python-loop layout) for one variant and prints the top functions by own time, and the
cumulative time of every function in `qax/`.

    PYTHONPATH=. python benchmarks/profile_tracing.py --variant qax [--what step|forward]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import warnings

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lora import Config, build_variants, fresh  # noqa: E402

import qax  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("dense", "hand", "qax"), default="qax")
    parser.add_argument("--what", choices=("step", "forward"), default="step")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--scan", action="store_true", help="layers under lax.scan")
    args = parser.parse_args(argv)
    warnings.simplefilter("error", qax.MaterializationWarning)

    variants, tokens = build_variants(Config(), scan=args.scan)
    v = variants[args.variant]
    if args.what == "step":
        run = lambda: jax.make_jaxpr(fresh(v.step))(v.params, v.opt_state, tokens)  # noqa: E731
    else:
        run = lambda: jax.make_jaxpr(fresh(v.loss))(v.params, tokens)  # noqa: E731
    run()
    run()
    start = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.reps):
        run()
    profile.disable()
    elapsed = (time.perf_counter() - start) / args.reps
    print(
        f"{args.variant} {args.what}: {elapsed * 1e3:.1f} ms per make_jaxpr (profiled)"
    )

    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    out.write("\n---- qax functions by cumulative time ----\n")
    stats.sort_stats("cumulative").print_stats(r"qax/", 40)
    print(out.getvalue())


if __name__ == "__main__":
    main()
