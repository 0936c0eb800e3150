"""The Llama family: Llama 3.x (``model``), Qwen2 and Qwen3 as variants (``qwen2``, ``qwen3``), and
their hub key map (``checkpoint``). Registered in :mod:`mtp_jax.builtin`."""
