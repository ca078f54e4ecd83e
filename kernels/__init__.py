"""Filled by a later issue (see the issues list): kernels."""
if __name__ != "hal.kernels":
    raise ImportError(f"this folder installs as 'hal.kernels', not {__name__!r}: pip install -e . and import hal.kernels")
