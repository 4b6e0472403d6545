"""Embedded default checkpoints (diffusers layout, safetensors)."""
