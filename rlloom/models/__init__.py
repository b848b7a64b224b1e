"""Native model code with Hugging Face weights: Llama/Qwen2/Qwen3, Qwen3-MoE/Mixtral, DeepSeek-V3.

Entry points: `from_pretrained(path_or_name, *, dtype, device) -> CausalLM`,
`save_pretrained(model, path)`, `load_tokenizer(path_or_name)`; weight sync uses
`hf_named_tensors(model)` (training side) and `load_hf_tensors(model, named_tensors)` (rollout
side, in place); the logprob head is `rlloom.models.logprobs.token_logprobs`.
"""

from rlloom.models.adapter import StateDictAdapter, hf_named_tensors, load_hf_tensors
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import from_pretrained, load_decoder, load_tokenizer, save_pretrained
from rlloom.models.model import CausalLM

__all__ = [
    "CausalLM",
    "ModelArgs",
    "StateDictAdapter",
    "from_pretrained",
    "hf_named_tensors",
    "load_hf_tensors",
    "load_decoder",
    "load_tokenizer",
    "save_pretrained",
]
