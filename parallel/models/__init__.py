"""Model families built from hal's parallel layers, one module each (``llama``; Mistral, Qwen2, Mixtral to come)."""
