"""Tensor kernels over the paged KV cache.

Every backend module exposes the same pure functions (see ``kernels/reference.py``, the spec):

- ``write_kv(k_cache, v_cache, k, v, slot_mapping)``
- ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out``
- ``prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale) -> out``
- ``gather_blocks(cache, block_ids) -> buf`` / ``scatter_blocks(cache, block_ids, buf)``

``get_backend(device)`` picks the implementation for a device.
"""
