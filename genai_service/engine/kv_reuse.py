"""KV reuse across requests: session KV, the in-process prefix index, the kvstore.

A session turn starts from the KV its session parked after the previous turn.
Any other context is cut into complete chunks of ``chunk_size`` tokens, each
keyed by its whole prefix (``prefix_cache.chunk_keys``;
docs/design.md, "KV chunk contract"). Chunks a
sequence has computed are put into the local ``PrefixIndex`` and pushed to the
kvstore (``KvChunkStore``), so a later request with the same prefix, on this
replica or another, starts with that KV written into the model runner instead
of recomputing it. Chunks the local index lacks are prefetched from the
kvstore in the background as soon as a request arrives; the scheduler admits
it once they have come (or not).

Each sequence's keys chain from its own namespace (``namespace_of``): the
model's, plus its prefix-sharing scope (the principal under scope
"principal"; a session turn uses its owner's) and its ``cache_salt``, so
requests in different scopes never reuse each other's KV.

A finished sequence keeps its runner slot until its chunks are shared
(``retire``, then ``store_finished`` in later steps, after its final output has
gone out); a session turn's KV is parked with its session (``park``).

Plain Python + numpy; never imports onnxruntime: the runner is used only
through ``kv_len``/``read_kv``/``write_kv``/``release``.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import TYPE_CHECKING

from .kv.kv_chunk_store import KvChunkStore
from .kv.kv_connector import GrpcKvChunkStore
from .kv.kv_integrity import KvIntegrity
from .kv.prefix_cache import PrefixIndex, chunk_keys, make_namespace, scoped_namespace
from .sequence import SeqStatus
from .sessions.sessions import cut_chunks

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..model.model_dir import ModelSpec
    from .kv.prefix_cache import KvLayers
    from .runner.model_runner import ModelRunner
    from .sequence import Sequence
    from .sessions.sessions import Session

STORE_CHUNKS_PER_STEP = 2  # chunks of finished sequences copied out per busy step


class KvReuse:
    """Finds, attaches and shares the KV of sequences' contexts.

    Reused tokens are counted into ``counters`` (the engine's):
    ``session_cached_tokens`` from a session's parked KV, ``prefix_cached_tokens``
    from the local index, ``kvstore_cached_tokens`` fetched from the kvstore.
    """

    def __init__(
        self,
        runner: ModelRunner,
        namespace: bytes,
        chunk_size: int,
        prefix_cache_bytes: int,
        remote: KvChunkStore | None = None,
        counters: Counter[str] | None = None,
        scope: str = "global",
        max_len: int = 2**31,
    ) -> None:
        self.runner = runner
        self.max_len = max_len  # KV positions a sequence may hold (the context window)
        self.namespace = namespace  # the model's; each sequence's is ``namespace_of``
        self.scope = scope  # CacheConfig.prefix_cache_scope
        self.chunk_size = chunk_size
        self.prefix_index = PrefixIndex(prefix_cache_bytes)
        self.remote = remote
        self.counters: Counter[str] = Counter() if counters is None else counters
        # Running sequences whose computed chunks are not all shared yet. Copying
        # a chunk out of the runner takes milliseconds (mostly page faults of
        # fresh memory), so it waits until the sequence finishes and its last
        # token is out, unless a new prompt needs the chunks sooner (``_share_running``).
        self._unshared: list[Sequence] = []
        # Finished sequences whose slots are kept until their chunks are shared.
        self.finished: list[Sequence] = []

    @classmethod
    def for_model(
        cls,
        runner: ModelRunner,
        spec: ModelSpec,
        config: EngineConfig,
        counters: Counter[str],
        chunk_store: KvChunkStore | None = None,
        max_len: int = 2**31,
    ) -> KvReuse:
        """The namespace from the model, its KV layout and the kvstore's integrity
        key; the kvstore connector from ``config.kvstore`` unless ``chunk_store``
        overrides it."""
        kv = spec.kv
        remote = chunk_store
        if remote is None and config.kvstore is not None:
            remote = GrpcKvChunkStore(
                config.kvstore.target,
                dtype=kv.dtype,
                timeout_s=config.kvstore.timeout_s,
                auth_token=config.kvstore.auth_token,
                tls_ca_file=config.kvstore.tls_ca_file,
                tls_cert_file=config.kvstore.tls_cert_file,
                tls_key_file=config.kvstore.tls_key_file,
                integrity=KvIntegrity(config.kvstore.integrity_key),
            )
        cache = config.cache
        namespace = make_namespace(
            spec.fingerprint,
            kv.dtype,
            f"L{kv.num_layers}.H{kv.num_kv_heads}.D{kv.head_dim}.hnd",
            cache.chunk_size,
            key_id=remote.integrity.key_id if remote is not None else b"",  # b"": in-process only
        )
        return cls(
            runner,
            namespace,
            cache.chunk_size,
            cache.prefix_cache_bytes,
            remote,
            counters,
            cache.prefix_cache_scope or "global",  # unresolved only without a server
            max_len,
        )

    def namespace_of(self, seq: Sequence) -> bytes:
        """The namespace of ``seq``'s chunk keys: the model's, scoped by who may
        share its prefixes (a session turn: the session's owner) and its salt."""
        request = seq.request
        principal = None
        if self.scope == "principal":
            principal = seq.session.owner if seq.session is not None else request.principal
        namespace = scoped_namespace(self.namespace, principal, request.cache_salt)
        if seq.lineage:  # its keys were moved by a slide (kv/window.next_lineage)
            namespace = hashlib.blake2b(namespace + seq.lineage, digest_size=16).digest()
        return namespace

    def after_slide(self, seq: Sequence, kept_chunks: int) -> None:
        """``seq`` has slid: its first ``kept_chunks`` stored chunks are still
        what they were (under the same keys); the rest are stored again as
        they complete. A stateless sequence whose keys moved shares no more:
        no other request has its lineage."""
        seq.stored_chunks = min(seq.stored_chunks, kept_chunks)
        if seq.lineage and seq.session is None:
            seq.shareable = False
            self.untrack(seq)
        elif seq.status is not SeqStatus.WAITING and seq not in self._unshared:
            self.track(seq)

    def track(self, seq: Sequence) -> None:
        """``seq``'s prompt is computed: share its chunks when it finishes
        (``store``), or as soon as another prompt begins with them."""
        if self.prefix_index.capacity_bytes or self.remote is not None:
            self._unshared.append(seq)

    def start_prefetch(self, seq: Sequence) -> None:
        """Ask the kvstore for the prompt's chunks the local index lacks (background)."""
        if self.remote is None or seq.request.prompt_logprobs:
            return  # (prompt logprobs: every position is computed)
        session = seq.session
        if session is not None and (session.kv is not None or session.committing):
            return  # its KV is resident
        keys = self._prompt_keys(seq)
        self._share_running(keys)
        local = self._local_run(keys)
        if local < len(keys):
            seq.prefix_keys, seq.prefetch_from = keys, local
            seq.prefetch = self.remote.prefetch(keys[local:])

    def attach(self, seq: Sequence) -> bool:
        """Attach reused KV before a sequence's first step: its session's parked KV,
        else the longest prefix found in the kvstore and the local index. False
        while that KV is not ready yet (the scheduler asks again next step). A
        request for prompt logprobs reuses nothing: every position is computed."""
        if seq.request.prompt_logprobs:
            return True
        session = seq.session
        if session is not None:
            if not session.kv_ready:
                return False  # the previous turn's last token is computed this step
            if session.kv is not None:
                self.runner.write_chunks(seq.seq_id, session.kv)
                seq.num_computed = seq.num_cached = session.kv_len
                session.kv, session.kv_len = None, 0
                self.counters["session_cached_tokens"] += seq.num_cached
                return True
        if seq.prefetch is not None:
            if not seq.prefetch.done():
                return False  # its chunks are on their way from the kvstore
            if self._attach_prefetched(seq):
                return True
        if self.prefix_index.capacity_bytes and seq.num_computed == 0:
            keys = self._prompt_keys(seq)
            self._share_running(keys)
            hits = self.prefix_index.match(keys)
            if hits:
                n = self._write(seq, self.prefix_index.gather(keys[:hits]))
                seq.stored_chunks = hits
                self.counters["prefix_cached_tokens"] += n
        return True

    def store(self, seq: Sequence, max_chunks: int | None = None) -> int:
        """Put the sequence's complete, not yet stored chunks (at most
        ``max_chunks``) into the prefix index and push them to the kvstore;
        returns how many were copied. A sequence whose chunks are all stored
        is no longer tracked."""
        if not self.unstored(seq):
            self.untrack(seq)
            return 0
        n_chunks = self._kv_len(seq) // self.chunk_size
        keys = chunk_keys(
            self.namespace_of(seq), seq.token_ids[: n_chunks * self.chunk_size], self.chunk_size
        )
        copied = 0
        for i in range(seq.stored_chunks, n_chunks):
            if max_chunks is not None and copied >= max_chunks:
                break
            seq.stored_chunks = i + 1
            if keys[i] in self.prefix_index:
                continue  # stored (and pushed) when it was first computed
            start = i * self.chunk_size
            layers = self.runner.read_kv(seq.seq_id, start, start + self.chunk_size)  # a copy
            copied += 1
            if self.prefix_index.capacity_bytes:
                self.prefix_index.put(keys[i], layers, copy=False)
            if self.remote is not None:
                self.remote.push(keys[i], layers)  # only reads them
        if seq.stored_chunks == n_chunks:
            self.untrack(seq)
        return copied

    def unstored(self, seq: Sequence) -> int:
        """Complete chunks of ``seq`` that ``store`` would still copy out."""
        if not seq.shareable or (not self.prefix_index.capacity_bytes and self.remote is None):
            return 0
        return max(0, self._kv_len(seq) // self.chunk_size - seq.stored_chunks)

    def _kv_len(self, seq: Sequence) -> int:
        """The KV of ``seq``'s own tokens: while a speculative step is being
        accepted, the runner may still hold draft tokens' KV past them."""
        return min(self.runner.kv_len(seq.seq_id), seq.num_computed)

    def untrack(self, seq: Sequence) -> None:
        """Forget a tracked sequence (stored, or its KV is not to be shared)."""
        if seq in self._unshared:
            self._unshared.remove(seq)

    def snapshot(self, seq: Sequence, n: int) -> list[KvLayers]:
        """The sequence's first ``n`` tokens of KV as chunks to park (a session
        between turns). Complete chunks the prefix index holds are the index's
        own arrays, shared rather than copied (nothing writes to them); the rest
        is copied out of the runner, each run of missing chunks in one piece."""
        size = self.chunk_size
        keys = chunk_keys(self.namespace_of(seq), seq.token_ids[: n - n % size], size)
        chunks: list[KvLayers] = []
        start = 0  # first token not yet in ``chunks``
        for i, key in enumerate(keys):
            if key in self.prefix_index:
                if start < i * size:
                    chunks.append(self.runner.read_kv(seq.seq_id, start, i * size))
                chunks.append(self.prefix_index.get(key))
                start = (i + 1) * size
        if start < n:
            chunks.append(self.runner.read_kv(seq.seq_id, start, n))
        return chunks

    def retire(self, seq: Sequence, shareable: bool) -> None:
        """``seq`` has finished: free its slot now, or, if it is ``shareable``
        and has chunks to share, once ``store_finished`` has copied them."""
        if shareable and self.unstored(seq):
            self.finished.append(seq)
        else:
            self.untrack(seq)
            self.runner.release(seq.seq_id)

    def store_finished(self, must_free: int, budgeted: bool) -> int:
        """Share the chunks of the ``finished`` sequences, then free their
        slots. ``budgeted`` (other sequences run): a few chunks per step, so a
        long context's copy never stalls them much; but the first ``must_free``
        slots are freed now, whatever their copies cost. Returns the chunks copied."""
        copied = 0
        while self.finished:
            seq = self.finished[0]
            if must_free > 0 or not budgeted:
                must_free -= 1
                copied += self.store(seq)
            elif copied < STORE_CHUNKS_PER_STEP:
                copied += self.store(seq, STORE_CHUNKS_PER_STEP - copied)
            if self.unstored(seq):
                break
            self.finished.pop(0)
            self.runner.release(seq.seq_id)
        return copied

    def park(self, seq: Sequence, session: Session) -> None:
        """Park the KV of ``seq`` with its session once a turn has computed the
        whole history; its chunks go to the prefix index first, so the parked
        KV shares them."""
        n = self.runner.kv_len(seq.seq_id)
        h = len(session.history)
        # The whole history, or (rewound while this was computed) a prefix of it.
        if h == n or (h < n and session.history == seq.token_ids[:h]):
            self.store(seq)
            session.kv, session.kv_len = (self.snapshot(seq, h), h) if h else (None, 0)

    def bequeath(self, seq: Sequence, session: Session, heir: Session) -> None:
        """Park with ``heir`` (a fork made while ``seq`` computed ``session``'s
        last token) the KV of ``seq`` that the fork's history begins with: the
        session's own parked chunks where they cover it (shared, not copied).
        (A turn already queued on the heir has attached nothing: it waited.)"""
        if heir.kv is not None:
            return
        n = min(self.runner.kv_len(seq.seq_id), len(heir.history))
        tokens = seq.token_ids
        if heir.history[:n] == tokens[:n]:
            common = n
        else:
            common = next(i for i in range(n) if heir.history[i] != tokens[i])
        if not common:
            return
        if session.kv is not None and common <= session.kv_len:
            heir.kv, heir.kv_len = cut_chunks(session.kv, common)
        else:
            heir.kv, heir.kv_len = self.snapshot(seq, common), common

    def keep_history(self, seq: Sequence, session: Session) -> None:
        """An aborted turn leaves the history as it was: park its KV if ``seq``
        (running) has computed all of it."""
        n = len(session.history)
        if seq.slides:
            return  # its context slid: its KV is no longer the history's
        if self.runner.kv_len(seq.seq_id) >= n > 0:
            session.kv, session.kv_len = self.snapshot(seq, n), n

    # -- internals ---------------------------------------------------------------

    def _share_running(self, keys: list[bytes]) -> None:
        """Store the chunks of running sequences that a new prompt with chunk
        ``keys`` begins with, so it reuses them instead of recomputing."""
        if not self._unshared or not keys:
            return
        i = self._local_run(keys)  # the first chunk the index lacks
        if i == len(keys):
            return
        size = self.chunk_size
        for other in list(self._unshared):
            if self._kv_len(other) < (i + 1) * size or other.stored_chunks > i:
                continue
            # Keys chain over the whole prefix and scope: equal i-th keys, equal
            # prefixes in the same scope.
            namespace = self.namespace_of(other)
            if chunk_keys(namespace, other.token_ids[: (i + 1) * size], size)[i] == keys[i]:
                self.store(other)
                i = self._local_run(keys)
                if i == len(keys):
                    return

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        # Never more than the runner holds (a turn's history and input may pass
        # the window before its slide).
        n = min(seq.prompt_len, self.max_len - 1)
        return chunk_keys(self.namespace_of(seq), seq.token_ids[:n], self.chunk_size)

    def _write(self, seq: Sequence, chunks: list[KvLayers]) -> int:
        """Write reused chunks as the sequence's KV, but never the whole prompt:
        the last prompt token is always computed, since its logits are needed.
        (A prompt that ends on a chunk boundary reuses all but that one token.)
        Returns the tokens reused."""
        n = min(len(chunks) * self.chunk_size, seq.prompt_len - 1)
        extra = len(chunks) * self.chunk_size - n
        if extra:
            keep = self.chunk_size - extra
            chunks = chunks[:-1] + [[(k[:, :keep], v[:, :keep]) for k, v in chunks[-1]]]
        if n > 0:
            self.runner.write_chunks(seq.seq_id, chunks)
        seq.num_computed = seq.num_cached = n
        return n

    def _local_run(self, keys: list[bytes]) -> int:
        """Leading ``keys`` present in the local index (without counting a lookup)."""
        n = 0
        while n < len(keys) and keys[n] in self.prefix_index:
            n += 1
        return n

    def _attach_prefetched(self, seq: Sequence) -> bool:
        """Write local + fetched chunks as the sequence's KV; False if nothing usable."""
        assert seq.prefetch is not None
        fetched = seq.prefetch.result()
        seq.prefetch = None
        keys, start = seq.prefix_keys, seq.prefetch_from
        if not fetched or self._local_run(keys[:start]) < start:
            return False  # nothing came, or local chunks were evicted meanwhile
        local = self.prefix_index.match(keys[:start]) if start else 0
        reused = self._write(seq, self.prefix_index.gather(keys[:local]) + fetched)
        seq.stored_chunks = local + len(fetched)
        if self.prefix_index.capacity_bytes:
            for i, chunk in enumerate(fetched):
                # read-only views of the fetched blob: nothing writes to them
                self.prefix_index.put(keys[local + i], chunk, copy=False)
        self.counters["prefix_cached_tokens"] += local * self.chunk_size
        self.counters["kvstore_cached_tokens"] += reused - local * self.chunk_size
        return True
