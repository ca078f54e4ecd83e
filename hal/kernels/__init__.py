"""Every implementation of a registry op beyond the plain-PyTorch reference, one module per source
(vendor fused ops, Triton kernels); each is declared in the ``hal.kernels`` entry points."""
