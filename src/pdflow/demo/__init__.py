"""The demo: a tiny seeded transformer whose paged KV cache moves from prefill to decode.

Kept free of imports so that ``import pdflow.demo`` stays cheap; the model lives in
``pdflow.demo.model`` and the paged KV cache in ``pdflow.demo.kvcache`` (both need torch).
"""
