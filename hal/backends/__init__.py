"""Vendor backends, one module each: the only package that touches torch.cuda / torch.npu / torch.mlu.

hetero-hal's own distribution registers the five built-ins in the ``hal.backends`` entry-point group
(pyproject.toml), exactly as a third-party vendor registers a plug-in; ``hal.backend_registry`` finds them.
"""
