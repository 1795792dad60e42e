"""The engine: requests in, per-step token deltas out.

Single-threaded and synchronous: the engine process (or a test) calls
``add_request``/``abort`` between ``step`` calls. A step is three calls:
``scheduler.schedule()``, ``runner.run(...)``, then ``_postprocess`` which
samples, applies stop rules and emits one ``RequestOutput`` per request that
moved. Nothing here waits on the network: a call or a request that needs a
session record from the kvstore waits as a ``PendingCall`` (``restores``)
while the steps go on.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import structlog

from genai_common.errors import (
    GenAIError,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
)

from ..config import EngineConfig
from . import sampler as sampling
from .detokenizer import IncrementalDetokenizer
from .kv_connector import KvChunkStore
from .kv_reuse import KvReuse
from .model_dir import ModelSpec, load_model_spec
from .model_runner import ModelRunner, StepItem
from .request import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestOutput,
    TokenLogprob,
    Usage,
    collect,
    merge_outputs,
)
from .restores import PendingCall, SessionRestores
from .runners import create_runner
from .sampling_rows import plain_greedy, sampling_row, token_logprob
from .scheduler import Scheduler
from .sequence import SeqStatus, Sequence
from .sessions import (
    Session,
    SessionInfo,
    SessionPage,
    SessionTable,
    not_found,
    record_key,
    session_record,
)
from .speculation import PromptLookup, follow_draft
from .stops import StopStringMatcher
from .tokenizer import Tokenizer
from .validation import resolve_max_new_tokens, validate_request

log = structlog.get_logger(__name__)

STORE_CHUNKS_PER_STEP = 2  # chunks of finished sequences copied out per busy step (_store_finished)
DEFAULT_CONTEXT_LENGTH = 2048  # when neither the graph nor a config says
DETOKENIZER_CONTEXT = 8  # prompt tokens given to the detokenizer as left context

T = TypeVar("T")


@dataclass(frozen=True)
class EngineInfo:
    model_id: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    runner_kind: str
    has_chat_template: bool
    kv_chunk_size: int


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec | None = None,
        tokenizer: Tokenizer | None = None,
        runner: ModelRunner | None = None,
        chunk_store: KvChunkStore | None = None,
    ) -> None:
        """``chunk_store`` overrides the kvstore connector made from ``config.kvstore``."""
        self.config = config
        self.spec = spec or load_model_spec(config.model_dir)
        self.tokenizer = tokenizer or Tokenizer.from_dir(self.spec.path, self.spec)
        context = self.spec.context_length or DEFAULT_CONTEXT_LENGTH
        if config.max_context_length is not None:
            context = min(context, config.max_context_length)
        self.context_length = context
        self.runner = runner or create_runner(
            self.spec, config.runner, max_slots=config.scheduler.max_num_seqs, max_len=context
        )
        self.vocab_size = self.spec.vocab_size
        self.counters: Counter[str] = Counter()
        self.kv_reuse = KvReuse.for_model(
            self.runner, self.spec, config, self.counters, chunk_store
        )
        # Reused KV is attached when a sequence is admitted to its first step.
        self.scheduler = Scheduler(config.scheduler, admit=self.kv_reuse.attach)
        # Aliases read by the engine process and tests; ``remote`` also carries
        # the session records.
        self.remote = self.kv_reuse.remote
        self.prefix_index = self.kv_reuse.prefix_index
        # The model's unscoped namespace: a request's chunk keys are those of
        # KvReuse.namespace_of (scoped by principal and cache_salt).
        self.namespace = self.kv_reuse.namespace
        self.chunk_size = self.kv_reuse.chunk_size
        self.sessions = SessionTable(
            config.sessions.max_sessions,
            config.sessions.idle_ttl_s,
            persistent=self.remote is not None,
        )
        self.restores = (
            SessionRestores(
                self.remote,
                self.sessions,
                self.vocab_size,
                self._kvstore_timeout_s,
                self.counters,
                record_key=self._record_key,
                max_fetches=config.sessions.max_record_fetches,
            )
            if self.remote is not None
            else None
        )
        self._requests: dict[str, Sequence] = {}
        # Requests waiting outside the scheduler for their session's record.
        self._parked: dict[str, tuple[GenerationRequest, PendingCall]] = {}
        self._pending: list[RequestOutput] = []
        # Final outputs of session turns waiting for their record to land in
        # the kvstore: (record key, give-up time, output).
        self._held: list[tuple[bytes, float, RequestOutput]] = []
        # Finished sequences whose slots are kept until their chunks are shared:
        # the copies are made after their final outputs have gone out.
        self._finished_kv: list[Sequence] = []
        self.last_step_idle = False  # the last step computed nothing (waiting on I/O)
        self._drafter: PromptLookup | None = None
        if config.speculation.num_tokens:
            if not self.runner.can_verify:
                raise ValueError(
                    "speculation: the graph returns only the last position's logits and has "
                    "no num_logits_to_keep input (convert it again, or use --speculate 0)"
                )
            self._drafter = PromptLookup(config.speculation)

    # -- public API ------------------------------------------------------------

    def info(self) -> EngineInfo:
        kv = self.spec.kv
        return EngineInfo(
            model_id=self.spec.model_id,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            eos_token_ids=tuple(self.spec.eos_token_ids),
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            kv_dtype=kv.dtype,
            runner_kind=self.runner.kind,
            has_chat_template=self.tokenizer.has_chat_template(),
            kv_chunk_size=self.chunk_size,
        )

    def add_request(self, request: GenerationRequest) -> None:
        """Validate and queue a request; raises a ``GenAIError`` if it cannot run.

        A turn of a session that is not in memory waits outside the scheduler
        for its record; if it then cannot run, its one output carries the error."""
        rid = request.request_id
        if rid in self._requests or rid in self._parked:
            raise InvalidArgument(f"request_id: {rid!r} is already in flight")
        if request.session_id is None:
            self._queue(request, None)
            return
        waiting = self.scheduler.num_waiting + len(self._parked)
        if request.session_id not in self.sessions and waiting >= self.config.scheduler.max_queue:
            # Turns parked for their record count toward the queue bound too.
            raise ResourceExhausted(
                f"queue: {waiting} requests waiting, the limit is "
                f"{self.config.scheduler.max_queue}; retry later"
            )
        queued = self._with_session(
            request.session_id, request.principal, lambda s: self._queue(request, s)
        )
        if isinstance(queued, PendingCall):
            self._parked[rid] = (request, queued)
            queued.add_done_callback(lambda ok, error: self._unpark(rid, ok, error))

    def _unpark(self, request_id: str, ok: bool, error: Any) -> None:
        self._parked.pop(request_id, None)
        if not ok:
            self._pending.append(RequestOutput(request_id, finished=True, error=error))

    def _queue(self, request: GenerationRequest, session: Session | None) -> None:
        history = session.history if session is not None else []
        validate_request(
            request,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            history_len=len(history),
            limits=self.config.limits,
        )
        if session is not None:
            self.sessions.begin_turn(session.session_id, request.request_id)
        try:
            seq = self._make_sequence(request, history, session)
            self.scheduler.add(seq)
            self.kv_reuse.start_prefetch(seq)
        except GenAIError:
            if session is not None:
                self.sessions.end_turn(session)
            raise
        self._requests[request.request_id] = seq
        self.counters["requests_added"] += 1

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its final output (``CANCELLED``) comes from the next step."""
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            request, pending = parked
            pending.cancel()
            self._pending.append(
                RequestOutput(
                    request_id,
                    finished=True,
                    finish_reason=FinishReason.CANCELLED,
                    usage=Usage(len(request.prompt_token_ids), 0, 0),
                    session_id=request.session_id,
                )
            )
            self.counters["requests_aborted"] += 1
            return True
        seq = self._requests.get(request_id)
        if seq is None or seq.status in (SeqStatus.FINISHED, SeqStatus.COMMITTING):
            return False
        self._finish(seq, FinishReason.CANCELLED, emit=True, abort=True)
        self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return (
            bool(self._pending or self._held or self._finished_kv or self.restores)
            or self.scheduler.has_work()
        )

    def close(self) -> None:
        """Share finished sequences' chunks, then release background resources
        (the kvstore connector, after its pushes have gone out)."""
        self.flush_finished()
        if self.remote is not None:
            self.remote.flush(self._kvstore_timeout_s)
            self.remote.close()

    def stats(self) -> dict[str, int]:
        """Counters and gauges for the frontend's /metrics."""
        return {
            **self.counters,
            "waiting": self.scheduler.num_waiting,
            "running": len(self.scheduler.running),
            "sessions": len(self.sessions),
            "prefix_cache_bytes": self.prefix_index.bytes_used,
            "prefix_cache_entries": len(self.prefix_index),
            "sessions_evicted": self.sessions.evicted,
            **{f"kvstore_{k}": v for k, v in (self.remote.stats() if self.remote else {}).items()},
        }

    @property
    def _kvstore_timeout_s(self) -> float:
        return self.config.kvstore.timeout_s if self.config.kvstore else 1.0

    def step(self) -> list[RequestOutput]:
        if self.restores:
            self.restores.poll()  # resumes calls and requests whose record arrived
        outputs, self._pending = self._pending, []
        outputs.extend(self._release_held())
        stored = self._store_finished()
        self._expire()
        batch = self.scheduler.schedule()
        self.last_step_idle = not batch and not stored
        if not batch:
            return outputs
        drafts = self._drafter.drafts(batch.items, self.context_length) if self._drafter else {}
        plain = [item for item in batch.items if item[0].seq_id not in drafts]
        items = [
            StepItem(
                seq.seq_id, seq.token_ids[seq.num_computed : seq.num_computed + n], seq.num_computed
            )
            for seq, n in plain
        ]
        try:
            checked = [
                (seq, draft, self.runner.verify(self._draft_item(seq, draft)))
                for seq, _ in batch.items
                if (draft := drafts.get(seq.seq_id))
            ]
            logits = self.runner.run(items) if items else None
        except Exception as exc:  # an ORT failure must not take the engine down
            log.exception("runner_failed", batch=[s.request_id for s, _ in batch.items])
            for seq, _ in batch.items:
                self._fail(seq, Internal(f"model runner failed: {exc}"))
            return outputs + self._drain_pending()
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += batch.num_tokens + sum(map(len, drafts.values()))
        for seq, draft, rows in checked:
            outputs.append(self._accept(seq, draft, rows))
        if logits is not None:
            outputs.extend(self._postprocess(plain, logits))
        return outputs + self._drain_pending()

    def run_to_completion(
        self, requests: Iterable[GenerationRequest]
    ) -> dict[str, GenerationResult]:
        """Add ``requests`` and step until all of them finish (tests, benchmarks)."""
        ids = []
        for request in requests:
            self.add_request(request)
            ids.append(request.request_id)
        outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        while any(not (o and o[-1].finished) for o in outputs.values()):
            for out in self.step():
                if out.request_id in outputs:
                    outputs[out.request_id].append(out)
            if self.last_step_idle:
                time.sleep(0.001)  # waiting on the kvstore, not on compute
        self.flush_finished()
        return {rid: collect(outs) for rid, outs in outputs.items()}

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.run_to_completion([request])[request.request_id]

    def wait(self, result: T | PendingCall) -> T:
        """The answer of a session call, stepping until a pending one is resolved
        (in-process callers: tests, tools; the engine process answers pending
        calls from its loop instead)."""
        if not isinstance(result, PendingCall):
            return result
        while not result.done:
            self.step()
            if self.last_step_idle:
                time.sleep(0.001)  # waiting on the kvstore
        if not result.ok:
            raise result.value
        return result.value  # type: ignore[no-any-return]

    # sessions

    def create_session(
        self,
        idle_ttl_s: float | None = None,
        owner: str = "",
        metadata: dict[str, str] | None = None,
    ) -> SessionInfo:
        session = self.sessions.create(idle_ttl_s, owner, metadata)
        self._save_session(session)
        return SessionTable.info(session)

    # The calls below that take a session id answer a ``PendingCall`` when
    # the session must first come from its kvstore record (``_with_session``).

    def get_session(self, session_id: str, principal: str = "") -> SessionInfo | PendingCall:
        return self._with_session(session_id, principal, SessionTable.info)

    def reset_session(self, session_id: str, principal: str = "") -> SessionInfo | PendingCall:
        def reset(session: Session) -> SessionInfo:
            session = self.sessions.reset(session.session_id)
            self._save_session(session)
            return SessionTable.info(session)

        return self._with_session(session_id, principal, reset)

    def close_session(self, session_id: str, principal: str = "") -> SessionInfo | PendingCall:
        def close(session: Session) -> SessionInfo:
            if session.running_request_id is not None:
                self.abort(session.running_request_id)  # closing cancels a running turn
            if self.remote is not None:
                self.remote.delete_record(self._record_key(session_id))
            return SessionTable.info(self.sessions.close(session_id))

        return self._with_session(session_id, principal, close)

    def list_sessions(
        self, principal: str = "", page_size: int = 0, page_token: str = ""
    ) -> SessionPage:
        """One page of the sessions in memory that ``principal`` owns (all of
        them when auth is off); see ``SessionTable.page``."""
        sessions, token = self.sessions.page(principal or None, page_size, page_token)
        return SessionPage([SessionTable.info(s) for s in sessions], token)

    def _with_session(
        self, session_id: str, principal: str, then: Callable[[Session], T]
    ) -> T | PendingCall:
        """``then(session)`` for the session ``principal`` may use, now if it is
        in memory, else (with a kvstore) as a ``PendingCall`` resolved once its
        record has arrived: the loop never waits for it."""
        session = self.sessions.find(session_id)
        if session is not None:
            return then(self._owned(session, principal))
        if self.restores is None or not self.restores.can_restore(session_id):
            raise not_found(session_id)
        pending = PendingCall()

        def resume(error: GenAIError | None) -> None:
            def run() -> T:
                if error is not None:
                    raise error
                return then(self._owned(self.sessions.get(session_id), principal))

            pending.resolve(run)

        self.restores.wait_for(session_id, resume)
        return pending

    @staticmethod
    def _owned(session: Session, principal: str) -> Session:
        if session.owner and session.owner != principal:
            raise PermissionDenied(
                f"session_id: session {session.session_id!r} belongs to another principal"
            )
        return session

    # -- internals ---------------------------------------------------------------

    def _make_sequence(
        self, request: GenerationRequest, history: list[int], session: Session | None
    ) -> Sequence:
        stopping = request.stopping
        seed = request.sampling.seed
        if seed is None:
            seed = secrets.randbits(63)
        token_ids = list(history) + list(request.prompt_token_ids)
        deadline = None
        if stopping.time_limit_ms is not None:
            deadline = time.monotonic() + stopping.time_limit_ms / 1000.0
        return Sequence(
            request=request,
            token_ids=token_ids,
            prompt_len=len(token_ids),
            max_new_tokens=resolve_max_new_tokens(request, self.config.limits),
            eos_token_ids=frozenset(() if stopping.ignore_eos else self.spec.eos_token_ids),
            stop_token_ids=frozenset(stopping.stop_token_ids),
            rng=np.random.default_rng(seed),
            seed=seed,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer.inner,
                token_ids[-DETOKENIZER_CONTEXT:],
                skip_special_tokens=request.skip_special_tokens,
            ),
            stop_matcher=StopStringMatcher(stopping.stop_sequences, stopping.include_stop_sequence),
            deadline=deadline,
            session=session,
        )

    def _postprocess(
        self, items: list[tuple[Sequence, int]], logits: np.ndarray
    ) -> list[RequestOutput]:
        to_sample: list[int] = []
        for i, (seq, n) in enumerate(items):
            seq.num_computed += n
            if seq.status is SeqStatus.COMMITTING:
                self._park_session(seq)
            elif seq.num_pending == 0:
                to_sample.append(i)
                if not seq.output_ids:
                    self.kv_reuse.track(seq)  # prompt done: its chunks are shareable
        if not to_sample:
            return []
        seqs = [items[i][0] for i in to_sample]
        if len(to_sample) < len(logits):
            logits = logits[to_sample]  # a copy: only when some rows are not sampled
        if all(plain_greedy(seq) for seq in seqs):
            # The common case needs no sampler set-up: a row-wise argmax.
            tokens = np.argmax(logits, axis=1)
            return [
                self._append_token(seq, int(t), None) for seq, t in zip(seqs, tokens, strict=True)
            ]
        rows = [sampling_row(seq, self.spec.sampling_defaults) for seq in seqs]
        sampled = sampling.sample(logits, sampling.prepare(rows))
        return [
            self._append_token(seq, *self._picked(seq, sampled, j)) for j, seq in enumerate(seqs)
        ]

    def _picked(
        self, seq: Sequence, sampled: sampling.SampleOutput, j: int
    ) -> tuple[int, TokenLogprob | None]:
        """Row ``j`` of the sampler's output: the token, and its logprobs if ``seq`` wants them."""
        token = int(sampled.token_ids[j])
        if seq.request.top_logprobs == 0:
            return token, None
        return token, token_logprob(
            token,
            float(sampled.logprobs[j]) if sampled.logprobs is not None else 0.0,
            sampled.top_token_ids[j],
            sampled.top_logprobs[j],
            self.tokenizer.token_text,
        )

    # -- speculative decoding (config.speculation) --------------------------------

    @staticmethod
    def _draft_item(seq: Sequence, draft: list[int]) -> StepItem:
        """The sequence's last token followed by the draft, in one step."""
        return StepItem(seq.seq_id, (seq.token_ids[-1], *draft), seq.num_computed)

    def _accept(self, seq: Sequence, draft: list[int], rows: np.ndarray) -> RequestOutput:
        """Pick tokens from ``rows`` as a plain decode would (``follow_draft``),
        append them one by one, and keep the KV of the agreed draft tokens only.
        Returns the step's tokens as one output."""
        chosen = follow_draft(draft, rows, lambda row, picked: self._choose(seq, row, picked))
        self.counters["spec_draft_tokens"] += len(draft)
        self.counters["spec_accepted_tokens"] += len(chosen) - 1
        assert self._drafter is not None
        self._drafter.feedback(seq.seq_id, len(chosen) - 1)
        start = seq.num_computed
        out: RequestOutput | None = None
        for j, (token, lp) in enumerate(chosen):
            # Every token but the last one is computed, as in a plain decode
            # (the runner may hold more until the trim below; KvReuse reads
            # only up to num_computed).
            seq.num_computed = start + 1 + j
            step = self._append_token(seq, token, lp)
            out = step if out is None else merge_outputs(out, step)
            if seq.finish_reason is not None:
                break
        if self.runner.kv_len(seq.seq_id) > seq.num_computed:  # unless released
            self.runner.truncate(seq.seq_id, seq.num_computed)  # drop rejected drafts' KV
        assert out is not None  # rows always has at least one row
        return out

    def _choose(
        self, seq: Sequence, row: np.ndarray, pending: list[int]
    ) -> tuple[int, TokenLogprob | None]:
        """The token a plain decode of ``seq`` would pick from ``row`` after
        ``pending`` (picked, not yet appended)."""
        if plain_greedy(seq, len(pending)):
            return int(np.argmax(row)), None
        args = sampling.prepare([sampling_row(seq, self.spec.sampling_defaults, pending)])
        return self._picked(seq, sampling.sample(row[None], args), 0)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> RequestOutput:
        seq.token_ids.append(token)
        seq.output_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        stopping = seq.request.stopping
        finish: FinishReason | None = None
        text = ""
        if token in seq.eos_token_ids:
            finish = FinishReason.EOS_TOKEN
        elif token in seq.stop_token_ids:
            finish = FinishReason.STOP_SEQUENCE
            seq.stop_sequence = self.tokenizer.token_text(token)
            # Text held back for a possible stop string is real output after all.
            text = seq.stop_matcher.flush() + seq.detokenizer.flush()
            if stopping.include_stop_sequence:
                text += seq.stop_sequence
        else:
            text, matched = seq.stop_matcher.feed(seq.detokenizer.add([token]))
            if matched is not None:
                finish, seq.stop_sequence = FinishReason.STOP_SEQUENCE, matched
        if finish is None:
            if len(seq.output_ids) >= seq.max_new_tokens:
                finish = FinishReason.MAX_TOKENS
            elif len(seq.token_ids) >= self.context_length:
                finish = FinishReason.CONTEXT_LENGTH
            elif seq.deadline is not None and time.monotonic() >= seq.deadline:
                finish = FinishReason.TIME_LIMIT
        if finish is None:
            return RequestOutput(seq.request_id, (token,), text, (lp,) if lp else ())
        if finish is not FinishReason.STOP_SEQUENCE:
            tail, matched = seq.stop_matcher.feed(seq.detokenizer.flush())
            text += tail
            if matched is not None:
                finish, seq.stop_sequence = FinishReason.STOP_SEQUENCE, matched
            else:
                text += seq.stop_matcher.flush()
        final = self._finish(seq, finish, emit=False)
        if seq.session is not None and self.remote is not None and self.config.kvstore:
            # Answer only once the session record is visible to other replicas,
            # so the next turn may go to any of them.
            key = self._record_key(seq.session.session_id)
            give_up = time.monotonic() + self.config.kvstore.record_wait_s
            self._held.append((key, give_up, final))
            return RequestOutput(seq.request_id, (token,), text, (lp,) if lp else ())
        return replace(final, token_ids=(token,), text=text, logprobs=(lp,) if lp else ())

    def _finish(
        self, seq: Sequence, reason: FinishReason, *, emit: bool, abort: bool = False
    ) -> RequestOutput:
        """Retire a request: free or park its KV, end its session turn, build its final output."""
        seq.finish_reason = reason
        self._requests.pop(seq.request_id, None)
        session = seq.session
        commit = False
        if session is not None:
            if abort:
                self._restore_session_after_abort(seq, session)
            else:
                session.history = list(seq.token_ids)
                session.turns += 1
                self._save_session(session)
                # The last sampled token has no KV yet: compute it next step so
                # the next turn reuses the whole history.
                commit = seq.num_pending == 1 and seq.status is SeqStatus.RUNNING
            self.sessions.end_turn(session)
        if commit and session is not None:
            seq.status = SeqStatus.COMMITTING
            session.committing = True
        else:
            self._retire(seq)
        self.counters["requests_finished"] += 1
        self.counters["generated_tokens"] += len(seq.output_ids)
        out = RequestOutput(
            seq.request_id,
            finished=True,
            finish_reason=reason,
            stop_sequence=seq.stop_sequence,
            usage=Usage(seq.prompt_len, len(seq.output_ids), seq.num_cached),
            seed=seq.seed,
            session_id=session.session_id if session else None,
            session_tokens=len(session.history) if session else 0,
        )
        if emit:
            self._pending.append(out)
        return out

    def _store_finished(self, *, all_now: bool = False) -> int:
        """Share the chunks of sequences that finished in earlier steps (their
        final outputs have gone out), then free their slots. While other
        sequences run, a few chunks per step, so a long context's copy never
        stalls them much; but as many slots as waiting requests need are freed
        now, whatever their copies cost. Returns the chunks copied."""
        scheduler = self.scheduler
        budgeted = scheduler.has_work() and not all_now
        # Slots the waiting requests could take that only finished sequences hold.
        occupied = len(scheduler.running) + len(self._finished_kv)
        must_free = min(
            len(self._finished_kv),
            scheduler.num_waiting - (self.config.scheduler.max_num_seqs - occupied),
        )
        copied = 0
        while self._finished_kv:
            seq = self._finished_kv[0]
            if must_free > 0 or not budgeted:
                must_free -= 1
                copied += self.kv_reuse.store(seq)
            elif copied < STORE_CHUNKS_PER_STEP:
                copied += self.kv_reuse.store(seq, STORE_CHUNKS_PER_STEP - copied)
            if self.kv_reuse.unstored(seq):
                break
            self._finished_kv.pop(0)
            self.runner.release(seq.seq_id)
        return copied

    def flush_finished(self) -> None:
        """Share every finished sequence's chunks and free their slots now."""
        self._store_finished(all_now=True)

    def _retire(self, seq: Sequence) -> None:
        shareable = seq.status is SeqStatus.RUNNING or seq.status is SeqStatus.COMMITTING
        seq.status = SeqStatus.FINISHED
        if self._drafter is not None:
            self._drafter.forget(seq.seq_id)
        self.scheduler.remove(seq)
        if shareable and self.kv_reuse.unstored(seq):
            self._finished_kv.append(seq)  # stored and released by a later step
        else:
            self.kv_reuse.untrack(seq)
            self.runner.release(seq.seq_id)

    def _restore_session_after_abort(self, seq: Sequence, session: Session) -> None:
        """An aborted turn leaves the history as it was; keep its KV if we have it."""
        n = len(session.history)
        if seq.status is SeqStatus.RUNNING and self.runner.kv_len(seq.seq_id) >= n > 0:
            session.kv, session.kv_len = self.kv_reuse.snapshot(seq, n), n

    def _park_session(self, seq: Sequence) -> None:
        session = seq.session
        assert session is not None  # only session sequences commit
        n = self.runner.kv_len(seq.seq_id)
        if len(session.history) == n and session.session_id in self.sessions:
            # Chunks go to the prefix index first, so the parked KV shares them.
            self.kv_reuse.store(seq)
            session.kv, session.kv_len = self.kv_reuse.snapshot(seq, n), n
        session.committing = False
        self._retire(seq)
        dropped = self.sessions.trim_parked_kv(self.config.sessions.max_parked_kv_bytes)
        self.counters["session_kv_evicted"] += dropped

    def _record_key(self, session_id: str) -> bytes:
        assert self.remote is not None  # records live in the kvstore
        return record_key(session_id, self.remote.integrity.key_id)

    def _save_session(self, session: Session) -> None:
        if self.remote is not None:
            self.remote.put_record(self._record_key(session.session_id), session_record(session))

    def _release_held(self) -> list[RequestOutput]:
        if not self._held:
            return []
        assert self.remote is not None
        now = time.monotonic()
        ready, waiting = [], []
        for key, give_up, out in self._held:
            if not self.remote.record_pending(key) or now >= give_up:
                ready.append(out)
            else:
                waiting.append((key, give_up, out))
        self._held = waiting
        return ready

    def _fail(self, seq: Sequence, error: GenAIError) -> None:
        if seq.status is SeqStatus.COMMITTING:
            if seq.session is not None:
                seq.session.committing = False
            self._retire(seq)
            return
        self._requests.pop(seq.request_id, None)
        if seq.session is not None:
            self.sessions.end_turn(seq.session)
        seq.status = SeqStatus.FINISHED  # its KV may be half-written: never share it
        self._retire(seq)
        self._pending.append(RequestOutput(seq.request_id, finished=True, error=error))

    def _expire(self) -> None:
        now = time.monotonic()
        for seq in self.scheduler.waiting():
            if seq.deadline is not None and now >= seq.deadline:
                self._finish(seq, FinishReason.TIME_LIMIT, emit=True, abort=True)
        self.sessions.expire_idle()

    def _drain_pending(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out
