"""What a run shows a person: the per-phase timer, the step timeline (measured beside simulated) and its
picture, TensorBoard scalars and the plan report. Reads plans and schedules; never changes a step."""
