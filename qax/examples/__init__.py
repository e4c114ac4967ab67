"""Example models for the qax walk-throughs (needs the ``examples`` extra: Flax).

`qax.examples.models` holds two small Flax language models that know nothing about
qax; the how-to notebook and ``notebooks/lora_finetune.py`` fine-tune them with LoRA.
`qax.examples.nnx_transformer` is a small Gemma-style Flax NNX decoder (einsum
attention kernels, fused QKV or grouped key/value heads, a tied embedding, layers
scanned with `nnx.scan`), used by ``tests/test_nnx_transformer.py`` and
``benchmarks/bench_qwix.py``. `qax.examples.moe` is a Mixtral-style mixture-of-experts
block in plain JAX (top-2 router, stacked experts through `jax.lax.ragged_dot` or a
capacity-bucketed einsum dispatch, layers under `jax.lax.scan`), used by
``tests/test_moe.py`` and ``benchmarks/bench_moe.py``. None is imported by ``import
qax``.
"""
