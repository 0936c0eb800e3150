"""Gemma 3 (text decoder): sliding-window local layers beside global ones. Registered in
:mod:`mtp_jax.builtin`."""
