"""Rules for primitives that carry a function, and for those that only annotate values.

Higher-order primitives (`jit`, `cond`, `scan`, `while`, `remat2`) hold a body written
for dense arrays. Their rules re-trace that body with `trace_body`: the body runs under a
fresh `ImplicitTrace` on the implicit values and is staged into a new jaxpr over their
flat leaves; the primitive is then bound on the leaves. Implicit values thus cross the
primitive as their leaves and stay implicit, and handlers apply inside the body.

Where outputs must share one structure (the branches of a `cond`, the carry of a loop
before and after an iteration) they are brought to their largest common structure
(`qax._structure`): only the parts that differ are materialized, with a warning that
says why. None of these rules materializes anything otherwise.

Primitives whose function JAX hands over as a `WrappedFun` (`custom_jvp_call`,
`custom_vjp_call`, `call`/`closed_call`, `shard_map`) are rebound with that function
wrapped to take and return flat leaves; custom derivative rules are kept.

Primitives that only annotate or move a value (`pvary`, `sharding_constraint`, `name`,
`optimization_barrier`, `copy`, `device_put`, `stop_gradient`) are applied to the leaves
of an implicit operand, and the implicit array is rebuilt around the results.

Modules (importing one registers its rules in the tables of `qax._dispatch`, each rule
right beside its definition):

- `_staging`: shared machinery: `trace_body`, the cache of staged bodies, materializing
  with a reason, per-leaf parameters and shardings, the `_Outputs` record.
- `jit`: `jit` and `checkpoint` (`remat`).
- `cond`: `cond` and `switch`.
- `loops`: `scan` and `while`.
- `custom_ad`: `call`/`closed_call` (`eval_jaxpr` on JAX > 0.11), `custom_jvp`,
  `custom_vjp`.
- `sharding`: `shard_map`, and the primitives that only annotate or move values.
"""

from . import cond as cond
from . import custom_ad as custom_ad
from . import jit as jit
from . import loops as loops
from . import sharding as sharding
