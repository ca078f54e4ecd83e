"""What a run leaves for people and machines: results.json and its readers (``results``), summary.md and the
terminal summary (``report``), report.html with its plots (``html_report``, ``plots``) and two runs side by side
(``compare``)."""
