"""The point-to-point operation record, shared by the communicator, the bridge and the peer check."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation for ``batch_p2p``: ``kind`` is "send" or "recv"."""

    kind: str
    tensor: torch.Tensor
    peer: int
