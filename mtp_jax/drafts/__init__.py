"""Draft models for speculative decoding."""
