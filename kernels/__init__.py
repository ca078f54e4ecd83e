"""Every implementation of a registry op beyond the plain-PyTorch reference, one module per source
(vendor fused ops, Triton kernels); each is declared in the ``hal.kernels`` entry points."""
if __name__ != "hal.kernels":
    raise ImportError(f"this folder installs as 'hal.kernels', not {__name__!r}: pip install -e . and import hal.kernels")
