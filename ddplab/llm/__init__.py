"""A language model and its trainer: the model every parallelism of chapters 9 and 10 composes on.

`model` is a Llama-style decoder in torchtitan's names, so that the plans of torch's own
tensor parallelism, FSDP2 and pipelining apply to it as they do to Llama 3.
"""

from ddplab.llm.model import ModelArgs, Transformer, check_tensor_parallel

__all__ = ["ModelArgs", "Transformer", "check_tensor_parallel"]
