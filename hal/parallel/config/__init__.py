"""What a run is, checked before anything starts: the parallel plan, the model section (and a Hugging Face
config.json mapped onto it), the train section, the planner's prediction a plan keeps, the topology (which ranks
form which stage and group), the job file every rank reads, and the memory and FLOP arithmetic the checks use.

Data only: nothing here builds a model or runs a step. It sits on ``schedules`` and nothing else of ``parallel``."""
