"""Pallas kernels, each beside a pure-jnp reference of the same signature and a dispatcher.

- :mod:`pallas_kernels.mla_decode`: MLA decode attention over the paged latent cache (Mosaic GPU).
- :mod:`pallas_kernels.moe`: grouped matmul for the routed experts, bf16 and block-FP8 (Pallas
  Triton backend for now), with jnp permute / combine.

Both are verified against their references in interpret mode on CPU; neither has been compiled on
a GPU yet, and the model still runs its pure-JAX paths (``mtp_jax.mla``, ``mtp_jax.moe``).
"""
