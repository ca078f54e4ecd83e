"""Upper bounds on every number a user gives (config keys, rank counts), each with the reason shown in
the message. They are checked while the config is read, before any topology, tensor or process exists,
so a typo of a few digits is one line instead of a MemoryError, an overflow in a rank or a fork bomb.
The bounds are generous: far above any run these machines make, far below what would exhaust them."""
from __future__ import annotations

import os

from hal.config.schema import Limit
from hal.errors import ConfigError

CORES = os.cpu_count() or 1

# processes one host starts (hal launch --nproc, hal bench --world-size, a local hal train)
LOCAL_RANKS = Limit(max(64, 8 * CORES), f"processes one host starts: 8 per core on this {CORES}-core host, at least 64")
DEVICES = Limit(4096, "devices in one stage or one grid dimension")
LAYERS = Limit(4096, "decoder layers")
CHUNKS = Limit(64, "model chunks (virtual stages) per pipeline stage: each one adds a boundary")
MICRO_BATCHES = Limit(65_536, "micro-batches in one step")
ROWS = Limit(65_536, "rows in one micro-batch")
STEPS = Limit(10**9, "steps in one run")
SEED = Limit(2**63 - 1, "torch generators take a 64-bit seed")
VOCAB = Limit(2**22, "tokens in a vocabulary")
WIDTH = Limit(2**16, "hidden width")
FFN_WIDTH = Limit(2**18, "feed-forward width")
HEADS = Limit(1024, "attention heads")
EXPERTS = Limit(4096, "experts in one MoE layer")
SEQUENCE = Limit(2**20, "tokens in one sequence")


def check_local_ranks(count: int, what: str) -> None:
    """Refuse to start more processes on this host than LOCAL_RANKS allows (one line, before any start)."""
    if count > LOCAL_RANKS.maximum:
        raise ConfigError(f"{what} {count} is above the limit {LOCAL_RANKS.maximum} ({LOCAL_RANKS.why}); use fewer ranks")
