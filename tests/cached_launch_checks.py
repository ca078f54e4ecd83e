"""Run in a process of its own, with Triton compiling (not interpreting, which keeps no parameter list): the
checks of tests/unit/test_cached_launch.py on the key CachedLauncher finds compiled kernels by. Needs no GPU: no
kernel is launched. Prints 'ok' when every check holds."""
from __future__ import annotations

import torch

from hal.kernels.triton import moe_exchange
from hal.kernels.triton.launch import CachedLauncher

# _push_rows(src, anchor, deltas, expert_of_row, routes, n_rows, local, capacity, H, VEC, BR, BH)
LAUNCHER = CachedLauncher(moe_exchange._push_rows)
BASE = torch.zeros(64, dtype=torch.int64)


def _args(**change: object) -> tuple[object, ...]:
    named = {"src": torch.zeros(4, 8, dtype=torch.bfloat16), "anchor": torch.zeros(4, 8, dtype=torch.bfloat16),
             "deltas": BASE[:4], "expert_of_row": BASE[8:12], "routes": BASE[16:32], "n_rows": 4, "local": 2,
             "capacity": 48, "H": 8, "VEC": 8, "BR": 128, "BH": 8}
    named.update(change)
    return tuple(named.values())


def _key(**change: object) -> tuple[object, ...]:
    return LAUNCHER._key(_args(**change), 8)


def main() -> None:
    assert LAUNCHER.constexpr == [False] * 8 + [True] * 4, LAUNCHER.constexpr
    specialised = {  # what Triton specialises on: a kernel compiled for one is wrong for the other
        "misaligned tensor": {"deltas": torch.zeros(64, dtype=torch.int64)[1:5]},  # 8 bytes off 16
        "other dtype": {"src": torch.zeros(4, 8, dtype=torch.float32)},
        "integer 1": {"local": 1},  # Triton makes it a constant
        "not a multiple of 16": {"capacity": 50},
        "past int32": {"capacity": 2**31},
        "constexpr value": {"H": 16},
    }
    for what, change in specialised.items():
        assert _key(**change) != _key(), f"{what}: the same key as the base arguments"
    other = torch.zeros(128, dtype=torch.int64)
    assert _key(deltas=other[32:36], expert_of_row=other[64:68]) == _key(), "other aligned tensors"
    assert _key(capacity=96) == _key(), "another multiple of 16"
    assert _key(n_rows=5) == _key(n_rows=7), "other odd values"
    assert LAUNCHER._key(_args(), 4) != LAUNCHER._key(_args(), 8), "num_warps"
    print("ok")


if __name__ == "__main__":
    main()
