"""A separate draft model: any checkpoint sharing the target's vocabulary (``draft``)."""
