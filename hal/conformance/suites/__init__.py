"""One module per suite (``ops``, ``precision``, ``collectives``, ``training``, ``onnx``), each exposing
``cases(ctx: Context) -> list[Case]``, and beside them the helpers one suite reads: the ops suite's input
generators (``inputs``), the ONNX golden data (``onnx_cases``), the collective checks both sides run
(``collective_checks``), the precision suite's tables and probes (``precision_checks``) and the small repeatable
training runs (``training_run``)."""
