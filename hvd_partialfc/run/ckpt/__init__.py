"""Checkpoints, resume, re-sharding, format upgrade."""
