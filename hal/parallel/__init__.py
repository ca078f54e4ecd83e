"""Training across heterogeneous islands, one room a job, bottom to top (a room imports only rooms below it):

    schedules, data,  schedule programs and their simulator; token files and batches;
    families          model families: their blocks, parameter arithmetic and Hugging Face mapping
    config            the run as checked data: model, replicas (a plain plan is the set of one), train, job file
    models, observe   parallel layers, parts and the stage; timer, timeline, step records, reports
    state             checkpoints and Hugging Face checks and export
    pipeline          one rank's engine, resharding between stages, compile
    replicas          a rank's ReplicaSet: its replica, shares, the gradient exchange, local SGD
    loop              hal train's parent side and the rank's training loop
    planner           profiles, cost model, search

tests/cli/test_layout.py checks the order."""
