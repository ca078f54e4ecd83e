"""Every implementation of a registry op beyond the plain-PyTorch reference, one module per source
(vendor fused ops, Triton kernels); each is declared in the ``hal.kernels`` entry points."""
if __name__ != "hal.kernels":
    # Run from the repository root, ``import kernels`` finds this folder. Libraries probe for Hugging Face's
    # own ``kernels`` package by importing that name (transformers does, on import): raising here would
    # break them, so the folder imports as an inert module with no version (the probe then reports "not
    # installed") and any real use of it is the error below.
    _WRONG_NAME = (f"this folder installs as 'hal.kernels', not {__name__!r}: pip install -e . and import hal.kernels "
                   "(Hugging Face's 'kernels' package is a different distribution)")

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(_WRONG_NAME)
