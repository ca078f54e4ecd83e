"""Training data: token files (``token_file``), the batches a run draws from them (``batches``) and
``hal data prepare``, which tokenizes text into a token file (``prepare``). Imports nothing of ``parallel``."""
