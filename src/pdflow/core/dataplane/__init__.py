"""Pure data-plane math: KV layouts, transfer planning and checksums.

It lives in the core because the rooms and the topology need it; the executors that carry
plans out live in :mod:`pdflow.dataplane`.
"""
