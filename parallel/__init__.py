"""Training across heterogeneous islands: model layers, parallel plans (data, tensor, pipeline,
ZeRO), the engine and trainer that run them, and checkpoints that reshard between plans."""
if __name__ != "hal.parallel":
    raise ImportError(f"this folder installs as 'hal.parallel', not {__name__!r}: pip install -e . and import hal.parallel")
