"""One rank's share of a pipelined step: the engine (its stage, its schedule's actions, the p2p between
stages), the remapping between stages whose layouts differ (``reshard``) and the compiled stage."""
