"""The built-in suite names, importable without torch (``hal conformance --help`` lists them)."""

SUITES: tuple[str, ...] = ("ops", "precision", "collectives", "training", "onnx", "contract")
