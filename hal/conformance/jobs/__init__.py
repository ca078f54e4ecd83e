"""Multi-rank conformance jobs: starting them through the launcher the context carries (``launch``), one rank of
a job (``worker``), the collectives job (``collective_job``) and the heterogeneous pipeline check
(``pipeline_check``)."""
