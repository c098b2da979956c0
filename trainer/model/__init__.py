"""The model and what wraps its blocks, in the order a rank applies them (torchtitan's):

- decoder.py: the Llama-style decoder, its sharding-invariant initialisation, FLOPs per token;
- attention.py: the explicit SDPA kernel (`attention=`) and what it keeps for backward;
- checkpointing.py: activation checkpointing around chosen blocks;
- compile.py: `torch.compile` per block, in place.
"""
