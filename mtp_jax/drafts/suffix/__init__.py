"""Suffix decoding (Arctic Inference; arXiv 2411.04975): drafts from the text's own repetitions and
from earlier requests' outputs, no weights. Registered in :mod:`mtp_jax.builtin`."""
