"""Checkpoint reading and writing: safetensors files and Hugging Face hub layouts."""

from mtp_jax.checkpoint.safetensors_io import CheckpointReader, SafetensorsFile, save_safetensors

__all__ = ["CheckpointReader", "SafetensorsFile", "save_safetensors"]
