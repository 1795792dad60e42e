"""The data-plane KV blob store (docs/design.md, "Processes and planes"): ``genai-kvstore``.

- ``blob``: KV chunk payloads (``pack_kv``/``unpack_kv``) and blob checksums
- ``client``: ``AsyncKvStoreClient`` and ``KvStoreClient``
- ``server``: the ``kvstore.v1.KvStore`` servicer, ``start_server`` and ``serve``
- ``store``, ``memory_tier``, ``disk_tier``: the tiers behind it
"""
