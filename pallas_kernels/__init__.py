"""Pallas kernels (MLA decode attention, MoE dispatch), each beside a pure-jnp reference.

Empty for now: the model runs its pure-JAX paths (``mtp_jax.mla``, ``mtp_jax.moe``) everywhere.
"""
