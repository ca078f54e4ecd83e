"""One rank's share of a pipelined step: its mesh (the communicators and topology it uses, and which group syncs,
shards or gathers each parameter), the engine (handed its stage, mesh, schedule and loss: the schedule's actions,
the p2p between stages), the builder that makes those four from a model and a plan (``build``), the remapping
between stages whose layouts differ (``reshard``) and the compiled stage."""
