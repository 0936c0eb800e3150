"""Pallas kernels, each beside a pure-jnp reference of the same signature and a dispatcher.

- :mod:`pallas_kernels.mla_decode`: MLA decode attention over the paged latent cache (Mosaic GPU).
- :mod:`pallas_kernels.moe`: grouped matmul for the routed experts, bf16 and block-FP8 (Mosaic GPU
  for Hopper; the earlier Pallas Triton kernel for sm_80/sm_89), with jnp permute / combine.

Both are verified against their references in interpret mode on CPU, lower for CUDA, and compile
and pass their native tests on an H100. The model calls both dispatchers (``mtp_jax.targets.deepseek_v3.mla``,
``mtp_jax.targets.deepseek_v3.moe``), which use the references / ``ragged_dot`` off a GPU.
"""
