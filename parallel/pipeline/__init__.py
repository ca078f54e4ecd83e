"""One rank's share of a pipelined step: its mesh (the communicators it uses and which of them syncs, shards or
gathers each parameter), the engine (its stage, its schedule's actions, the p2p between stages), the remapping
between stages whose layouts differ (``reshard``) and the compiled stage."""
