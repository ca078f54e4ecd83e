"""The planner: device profiles (``device_profile`` holds the numbers, ``profile_store`` reads and writes the
files, ``make_profile`` measures or estimates them through ``measure`` and ``estimate``), the cluster
(``cluster``), a cost model over the schedule simulator (``cost``, ``calibrate``), the plan search
(``search``) and ``hal plan --search`` end to end (``run_search``). The top room: it may use every other."""
