"""Vendor backends, one module each. The only package that touches torch.cuda / torch.npu / torch.mlu.

``BUILTIN_BACKENDS`` maps hal backend names to ``module:Class``; third parties add more through
the ``hal.backends`` entry-point group (see ``hal.backend_registry``).
"""

BUILTIN_BACKENDS: dict[str, str] = {
    "cpu": "backends.cpu:CpuBackend",
    "cuda": "backends.cuda:CudaBackend",
    "rocm": "backends.rocm:RocmBackend",
    "ascend": "backends.ascend:AscendBackend",
    "cambricon": "backends.cambricon:CambriconBackend",
}
