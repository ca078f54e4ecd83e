"""Filled by a later issue (see the issues list): parallel."""
if __name__ != "hal.parallel":
    raise ImportError(f"this folder installs as 'hal.parallel', not {__name__!r}: pip install -e . and import hal.parallel")
