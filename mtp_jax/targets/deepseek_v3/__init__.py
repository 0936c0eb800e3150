"""DeepSeek-V3 / R1 / Kimi-K2: MLA attention over a paged latent cache (``mla``), group-limited
mixture of experts (``moe``) and its expert-parallel form (``ep``), the target (``model``) and the
hub key map (``checkpoint``). Registered in :mod:`mtp_jax.builtin`."""
