"""The model and what wraps its blocks, in the order a rank applies them (torchtitan's):

- decoder.py: the Llama-style decoder, its sharding-invariant initialisation, FLOPs per token;
- moe.py: `model.n_experts`: a mixture of experts (router, experts, balance losses, the ep all-to-alls, the router log);
- pipeline_split.py: `parallel.pp`: the blocks of each pipeline stage (`stage_blocks`, the one split), a stage's module;
- fp8.py: `precision=fp8`: the block linears as torchao's Float8Linear, and which stay bf16 (shapes only);
- loss.py: next-token cross-entropy in fp32, over all logits at once or by chunks of tokens;
- hf_config.py: `model=hf`: the shapes of a Hugging Face config.json (a leaf: config/model.py reads it);
- hf_weights.py: `model.weights`: a Hugging Face checkpoint checked, loaded into each rank's shard, its key map;
- attention.py: the explicit SDPA kernel (`attention=`) and what it keeps for backward;
- context_parallel.py: `parallel.cp`: the head-tail split of each sequence, Ulysses' all-to-alls, the K/V all-gather;
- checkpointing.py: activation checkpointing around chosen blocks;
- compile.py: `torch.compile` per block, in place;
- op_names.py: `checkpointing.save_ops` names resolved to torch operators (a leaf: config/checkpointing.py checks them).
"""
