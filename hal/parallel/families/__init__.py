"""Model families as specs: for each Hugging Face family hal's decoder represents (Llama, Mistral, Qwen2, Mixtral,
Qwen2-MoE), what its config.json means in ``model:`` keys, which layers that chooses (a q, k, v bias, an MoE
block), its tensor names, and what export writes back. One module a family plus its line in ``registry``.

Pure data and dict arithmetic: nothing of torch, nothing of the other rooms; the config, models and state rooms
ask a family, never a family's name."""
