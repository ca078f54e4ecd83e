"""Triton kernels for hal's registry ops: one module per op family, each importing triton at its top.

Nothing here is imported when hal loads: ``hal.kernels.triton_ops`` registers the ops and
``hal.kernels.triton.library`` defines the torch.library custom ops; a kernel module is imported by
the first custom op that runs it. On CPU tensors the kernels run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported) — that is how CI tests them.
"""
