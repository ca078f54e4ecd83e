"""The parallel layers and the stage built from them: tensor-parallel collectives (``tp_comm``), the weight-gradient
split the zero-bubble schedules defer (``weight_grad``), the parallel linear, embedding and norm layers (``layers``,
``linear``), the parts a family builds its blocks from (``parts``), the pipeline stage and the whole model
(``stage``), full-shape gathers of a sharded stage (``shards``), the loss and fused head, the MoE block
(``moe``, ``moe_layer``), and the Hugging Face tensor names laid over a stage's parameters and the weight loader
(``hf_names``, ``hf_weights``).

Sits on ``config`` and ``families`` (a family's blocks, built from ``parts``): a stage is built from a ModelConfig,
never from a plan or a schedule."""
