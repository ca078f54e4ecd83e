"""The parallel layers and the decoder built from them: tensor-parallel collectives (``tp_comm``), the
weight-gradient split the zero-bubble schedules defer (``weight_grad``), linear and decoder layers, the loss and
fused head, the MoE block, the Llama-shaped decoder every registered family is (``decoder``; the families
themselves, with their names and keys, are ``parallel.families``), and the Hugging Face tensor names laid over
its parameters and the weight loader (``hf_names``, ``hf_weights``).

Sits on ``config`` and ``families``: a stage is built from a ModelConfig, never from a plan or a schedule."""
