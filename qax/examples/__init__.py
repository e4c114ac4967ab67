"""Example models for the qax walk-throughs (needs the ``examples`` extra: Flax).

`qax.examples.models` holds two small Flax language models that know nothing about
qax; the how-to notebook and ``notebooks/lora_finetune.py`` fine-tune them with LoRA.
It is not imported by ``import qax``.
"""
