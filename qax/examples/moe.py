"""A Mixtral-style mixture-of-experts block in plain JAX.

Nothing in this module knows about qax: it is written the way MoE layers are written in
JAX (MaxText, the JAX serving engines), so that tests and benchmarks can show qax's
LoRA and quantized weights working on code they have never seen.

- A router (a ``(d_model, n_experts)`` kernel) scores every token; each token goes to
  its `top_k` experts (two, as in Mixtral), weighted by the softmax of the router's
  logits renormalised over the chosen experts.
- The experts are SwiGLU MLPs held as stacked weights: ``w_gate`` and ``w_up`` of
  shape ``(n_experts, d_model, d_ff)``, ``w_down`` ``(n_experts, d_ff, d_model)``.
- ``dispatch="ragged"`` (the default): the token copies are sorted by expert and go
  through the experts with `jax.lax.ragged_dot` (one grouped product per weight).
- ``dispatch="einsum"``: a capacity-bucketed dispatch (GShard / Switch style): a
  one-hot dispatch tensor ``(slots, experts, capacity)`` puts the token copies in
  per-expert buckets, the experts run as ``einsum('ecd,edf->ecf')``, and a combine
  einsum brings them back. With the default capacity (every copy fits) both forms
  compute the same function; a smaller capacity drops the copies that overflow.
- `moe_layers` runs a stack of pre-norm residual MoE blocks with `jax.lax.scan` over
  the leading layer axis of every weight (`init_moe` builds them stacked).

Weights are random, from a fixed seed.

Examples:
    >>> cfg = MoEConfig(d_model=8, d_ff=16, n_experts=4, n_layers=2)
    >>> params = init_moe(jax.random.PRNGKey(0), cfg)
    >>> params["layers"]["experts"]["w_gate"].shape
    (2, 4, 8, 16)
    >>> x = jnp.ones((2, 3, 8))
    >>> moe_layers(params, x, cfg).shape
    (2, 3, 8)
    >>> y = moe_layers(params, x, cfg, dispatch="einsum")
    >>> bool(jnp.allclose(y, moe_layers(params, x, cfg), atol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["MoEConfig", "init_moe", "moe_block", "moe_layers", "route"]

_DISPATCH = ("ragged", "einsum")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The sizes of a stack of MoE blocks.

    Attributes:
      d_model: the width of the residual stream.
      d_ff: the hidden width of each expert.
      n_experts: the number of experts per block.
      top_k: the experts each token goes to.
      n_layers: the number of blocks (stacked along a leading axis).
    """

    d_model: int = 64
    d_ff: int = 128
    n_experts: int = 4
    top_k: int = 2
    n_layers: int = 2


def init_moe(key: jax.Array, cfg: MoEConfig) -> dict[str, Any]:
    """Random parameters for `moe_layers`, each stacked along a leading layer axis.

    Returns:
      ``{"layers": {"norm": {"scale"}, "router": {"kernel"}, "experts": {"w_gate",
      "w_up", "w_down"}}}`` with shapes ``(L, d)``, ``(L, d, E)``, ``(L, E, d, f)``,
      ``(L, E, d, f)`` and ``(L, E, f, d)``.
    """
    L, d, f, E = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_experts
    k = jax.random.split(key, 4)

    def normal(key, shape, fan_in):
        return jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)

    return {
        "layers": {
            "norm": {"scale": jnp.ones((L, d), jnp.float32)},
            "router": {"kernel": normal(k[0], (L, d, E), d)},
            "experts": {
                "w_gate": normal(k[1], (L, E, d, f), d),
                "w_up": normal(k[2], (L, E, d, f), d),
                "w_down": normal(k[3], (L, E, f, d), f),
            },
        }
    }


def route(router_kernel: jax.Array, x: jax.Array, top_k: int) -> tuple:
    """Mixtral's router: for tokens ``x (T, d)``, the chosen experts ``(T, top_k)``
    and their weights ``(T, top_k)`` (the softmax of the logits, renormalised over the
    chosen experts)."""
    logits = x @ router_kernel
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights.astype(x.dtype)


def _swiglu_ragged(experts: dict, xs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    gate = lax.ragged_dot(xs, experts["w_gate"], group_sizes)
    up = lax.ragged_dot(xs, experts["w_up"], group_sizes)
    return lax.ragged_dot(jax.nn.silu(gate) * up, experts["w_down"], group_sizes)


def _ragged(experts: dict, x: jax.Array, chosen: jax.Array, n_experts: int) -> Any:
    """Every token copy through its expert, copies sorted by expert: ``(T·k, d)`` in
    the order of ``chosen.reshape(-1)``."""
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    k = chosen.shape[-1]
    xs = jnp.take(x, order // k, axis=0)
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    ys = _swiglu_ragged(experts, xs, group_sizes)
    return jnp.zeros_like(ys).at[order].set(ys)


def _einsum(experts: dict, x: jax.Array, chosen: jax.Array, n_experts: int, capacity):
    """Every token copy through its expert by a capacity-bucketed dispatch; copies
    past an expert's capacity give zeros (dropped)."""
    k = chosen.shape[-1]
    flat = chosen.reshape(-1)
    capacity = flat.shape[0] if capacity is None else capacity
    mask = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)  # (slots, E)
    position = jnp.cumsum(mask, axis=0) * mask - 1  # place in its expert's bucket
    dispatch = jax.nn.one_hot(position, capacity, dtype=x.dtype)  # (slots, E, C)
    xs = jnp.repeat(x, k, axis=0)  # (slots, d)
    buckets = jnp.einsum("sec,sd->ecd", dispatch, xs)
    gate = jnp.einsum("ecd,edf->ecf", buckets, experts["w_gate"])
    up = jnp.einsum("ecd,edf->ecf", buckets, experts["w_up"])
    out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, experts["w_down"])
    return jnp.einsum("sec,ecd->sd", dispatch, out)


def moe_block(
    params: dict,
    x: jax.Array,
    cfg: MoEConfig,
    *,
    dispatch: str = "ragged",
    capacity: int | None = None,
) -> jax.Array:
    """One MoE feed-forward: each token through its `top_k` experts, weighted.

    Args:
      params: ``{"router": {"kernel": (d, E)}, "experts": {"w_gate": (E, d, f),
        "w_up": (E, d, f), "w_down": (E, f, d)}}`` (one layer of `init_moe`'s).
      x: tokens ``(..., d)``.
      cfg: the sizes.
      dispatch: ``"ragged"`` (`jax.lax.ragged_dot` over copies sorted by expert) or
        ``"einsum"`` (capacity buckets).
      capacity: ``"einsum"`` only: token copies per expert (default: all of them, so
        nothing is dropped).

    Returns:
      An array of ``x``'s shape.

    Raises:
      ValueError: an unknown ``dispatch``.
    """
    if dispatch not in _DISPATCH:
        raise ValueError(f"moe_block: dispatch={dispatch!r}; use one of {_DISPATCH}.")
    lead = x.shape[:-1]
    tokens = x.reshape(-1, x.shape[-1])
    chosen, weights = route(params["router"]["kernel"], tokens, cfg.top_k)
    if dispatch == "ragged":
        ys = _ragged(params["experts"], tokens, chosen, cfg.n_experts)
    else:
        ys = _einsum(params["experts"], tokens, chosen, cfg.n_experts, capacity)
    ys = ys.reshape(*chosen.shape, -1)  # (T, k, d)
    out = jnp.einsum("tkd,tk->td", ys, weights.astype(ys.dtype))
    return out.reshape(*lead, -1).astype(x.dtype)


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(var + 1e-6) * scale


def moe_layers(
    params: dict,
    x: jax.Array,
    cfg: MoEConfig,
    *,
    dispatch: str = "ragged",
    capacity: int | None = None,
) -> jax.Array:
    """The stacked blocks of `init_moe`, ``x + moe_block(rms_norm(x))`` each, run with
    `jax.lax.scan` over the layer axis.

    Args:
      params: `init_moe`'s parameters.
      x: ``(..., d_model)``.
      cfg: the sizes.
      dispatch: as for `moe_block`.
      capacity: as for `moe_block`.

    Returns:
      An array of ``x``'s shape.
    """

    def layer(h, p):
        y = _rms_norm(h, p["norm"]["scale"])
        return h + moe_block(p, y, cfg, dispatch=dispatch, capacity=capacity), None

    out, _ = lax.scan(layer, x, params["layers"])
    return out
