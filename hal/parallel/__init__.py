"""Training across heterogeneous islands, one room a job, bottom to top (a room imports only rooms below it):

    schedules, data,  schedule programs and their simulator; token files and batches;
    families          model families as specs (Hugging Face keys, names, export)
    config            the run as checked data: plan, model, train, topology, job file
    models, observe   parallel layers and model families; timer, timeline, reports
    state             checkpoints and Hugging Face checks and export
    pipeline          one rank's engine, resharding between stages, compile
    replicas          whole replicas beside each other: their shares, the gradient exchange, local SGD
    loop              hal train's parent side and the rank's training loop
    planner           profiles, cost model, search

tests/cli/test_layout.py checks the order."""
