"""Reusable test helpers (multi-process launching)."""
