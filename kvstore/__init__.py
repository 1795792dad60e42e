"""The data-plane KV blob store (docs/design.md, "Processes and planes"): ``genai-kvstore``.

- ``checksum``: blob checksums, the one place the data plane hashes a blob
- ``client``: ``AsyncKvStoreClient`` and ``KvStoreClient``
- ``server``: the ``kvstore.v1.KvStore`` servicer, ``start_server`` and ``serve``
- ``store``, ``memory_tier``, ``disk_tier``: the tiers behind it
"""
