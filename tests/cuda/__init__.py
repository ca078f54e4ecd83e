"""Tests that need an NVIDIA GPU (marked ``cuda``; skipped elsewhere, run on the device machines)."""
