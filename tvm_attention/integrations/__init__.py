"""Integrations of tvm-attention kernels into other frameworks.

``tvm_attention.integrations.transformers``: a Hugging Face transformers attention backend
(``register()``, then ``attn_implementation="tvm_attention"``). Each integration imports its
framework only when imported itself.
"""
