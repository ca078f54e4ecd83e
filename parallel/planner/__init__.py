"""The planner: device profiles (``profile``, ``measure``, ``estimate``), the cluster (``cluster``), a cost model over
the schedule simulator (``cost``, ``calibrate``), the plan search (``search``, ``plan_search``) and the prediction a
written plan keeps (``planned``)."""
