"""Integrations of sdpa_math with model libraries (import each submodule explicitly)."""
