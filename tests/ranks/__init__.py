"""Tests that need a world of ranks (CPU + gloo, world <= 4): engines, collectives, checkpoints, the bridge."""
