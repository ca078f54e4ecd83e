"""The names this module held before a family owned its blocks, kept for importers outside the models room that
have not moved yet: the stage is ``parallel.models.stage``'s, the gathers ``parallel.models.shards``'s, the Llama
decoder's blocks ``parallel.families.llama.blocks``' and the rotary tables ``parallel.families.rotary``'s.
New code imports them from there."""
from __future__ import annotations

from hal.parallel.families.llama.blocks import MLP, Attention, DecoderLayer
from hal.parallel.families.rotary import rope_tables
from hal.parallel.models.moe_layer import MoEFeedForward
from hal.parallel.models.shards import gather_full, gather_full_grads, gather_full_params
from hal.parallel.models.stage import (
    Stage,
    build_stage,
    check_tp,
    full_init,
    full_model,
    init_stage,
    param_seed,
    sync_tied_embedding_grads,
)

__all__ = [
    "Attention", "DecoderLayer", "MLP", "MoEFeedForward", "Stage", "build_stage", "check_tp", "full_init",
    "full_model", "gather_full", "gather_full_grads", "gather_full_params", "init_stage", "param_seed", "rope_tables",
    "sync_tied_embedding_grads",
]
