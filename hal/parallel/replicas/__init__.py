"""Replicas: whole plans side by side on different islands, each training its share of the batch (its plan data is
``parallel.config.replicas``). ``replica_set.ReplicaSet`` is what a rank's loop talks to — a plain plan is the set
of one, whose every call is a no-op; behind it the meeting (``sync``), local SGD, the overlap and the shares."""
