"""KV blocks beyond the cache: prefix-cache blocks evicted from the KV cache move down to a host-memory
tier and from there to a local-disk tier, and come back when a prompt's prefix lives below.

    block_file.py  one block on disk: header, token ids, payload, checksum (pure)
    host.py        the host-memory tier: fixed slots (pinned on CUDA), LRU, pins
    disk.py        the disk tier: one file per block, written by a background thread, LRU by bytes
    tiers.py       `KVTiers`: what the engine calls (offload on eviction, find, restore, prefetch)
"""
