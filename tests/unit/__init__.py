"""Tests that start no process: one module, one function, in this interpreter (the fast lane)."""
