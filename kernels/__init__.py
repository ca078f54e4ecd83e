"""Filled by a later issue (see the issues list): kernels."""
