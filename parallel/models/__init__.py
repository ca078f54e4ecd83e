"""The parallel layers and the model family built from them: tensor-parallel collectives (``tp_comm``),
the weight-gradient split the zero-bubble schedules defer (``weight_grad``), linear and decoder layers,
the loss and fused head, the MoE block, the Llama-family decoder (``llama``: Llama, Mistral, Qwen2, Mixtral,
Qwen2-MoE) and its Hugging Face tensor names and weight loader (``hf_names``, ``hf_weights``).

Sits on ``config``: a stage is built from a ModelConfig, never from a plan or a schedule."""
