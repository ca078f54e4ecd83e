"""Model families: for each Hugging Face family hal represents (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, Qwen3,
GPT-NeoX), its blocks, its parameter and FLOP arithmetic, what its config.json means in ``model:`` keys, its tensor
names and what export writes back. One module (or folder, for a family with blocks of its own) plus its line in
``registry``.

The specs are data and arithmetic and import nothing of torch or of the other rooms: the config, models and state
rooms ask a family, never a family's name. A family's ``blocks`` module (torch) is imported only when a stage is
built, and builds from the parallel parts the stage hands it (``spec.Parts``)."""
