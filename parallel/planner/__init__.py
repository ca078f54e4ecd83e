"""The planner's home (filled by a later issue): device profiles, a cost model from the schedule simulator, and the plan search."""
