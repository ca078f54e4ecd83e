"""Training runs: the parent side of ``hal train`` (``job_runner``: checks, job file, starting the ranks,
their summary) and the rank's loop (``trainer``) with its optimizer schedule, loss scale and ZeRO-1."""
