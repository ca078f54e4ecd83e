"""Replicas: whole plans side by side on different islands, each training its share of the batch (its plan data is
``parallel.config.replicas``); here their meshes' meeting — the cross-replica gradient sum (``sync``)."""
