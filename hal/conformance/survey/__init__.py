"""The operator survey: every OpInfo of PyTorch's ``op_db`` on a backend's device, judged against the CPU.

``cohort`` picks the (op, dtype) pairs and pins them by a digest; ``samples`` moves OpInfo's sample inputs between
devices and dtypes; ``judge`` compares a result with its references; ``pair`` surveys one op in one dtype;
``run`` drives the whole survey (processes, progress); ``tables`` turns findings into rates, tables and files.
"""
