"""Environments: the GEM / Gymnasium-shaped API, built-in environments and the env-server."""
