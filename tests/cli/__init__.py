"""Tests of whole processes: the ``hal`` command as a user runs it, scripts, pip and wheel builds."""
