"""The engine: requests in, per-step token deltas out.

Single-threaded and synchronous: the engine process (or a test) calls
``add_request``/``abort`` between ``step`` calls. A step is three calls:
``scheduler.schedule()``, ``_run`` (the model runner, and the verification of
speculative drafts), then ``_postprocess`` which picks tokens, applies stop
rules and emits one ``RequestOutput`` per request that moved. Nothing here
waits on the network: a call or a request that needs a session record from
the kvstore waits as a ``PendingCall`` (``restores``) while the steps go on.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from genai_common.errors import GenAIError, Internal, InvalidArgument, ResourceExhausted

from ..config import EngineConfig
from ..contract.request import (
    EngineInfo,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    TokenLogprob,
    merge_outputs,
)
from ..contract.sessions import SessionInfo, SessionPage
from ..guidance.constraints import Guidance
from ..model.model_dir import ModelSpec, load_model_spec
from ..model.tokenizer import Tokenizer, vocabulary_mismatch
from .groups.completions import Completions
from .in_process import InProcessDriver
from .kv.kv_chunk_store import KvChunkStore
from .kv.window import SlidePolicy, next_lineage
from .kv_reuse import KvReuse
from .runner.model_runner import ModelRunner, StepItem
from .runner.runners import create_runner
from .sampling_rows import TokenPicker, prompt_logprobs
from .scheduler import ScheduledBatch, Scheduler
from .sequence import SeqStatus, Sequence, new_sequence
from .sessions.restores import HeldOutputs, ParkedRequests, PendingCall, SessionCalls
from .sessions.sessions import Session, SessionTable, slide_turn_ends
from .speculation import Draft, DraftModel, Speculation
from .text.token_texts import TokenTexts
from .validation import (
    resolve_max_new_tokens,
    truncate_prompt,
    validate_completions,
    validate_request,
)

log = structlog.get_logger(__name__)

DEFAULT_CONTEXT_LENGTH = 2048  # when neither the graph nor a config says


@dataclass(frozen=True)
class _Computed:
    """What ``_run`` computed for a batch: the logits of its plain items
    ([len(plain), vocab]; None if all were drafted) and each drafted
    sequence's verification rows ([len(draft) + 1, vocab])."""

    plain: list[tuple[Sequence, int]]
    logits: np.ndarray | None = None
    verified: list[tuple[Sequence, Draft, np.ndarray]] = field(default_factory=list)
    masks: Future[dict[int, np.ndarray]] | None = None  # constrained rows' masks, by seq_id


def _step_item(seq: Sequence, tokens: list[int] | tuple[int, ...]) -> StepItem:
    """``tokens`` fed to ``seq`` from its first position without KV."""
    return StepItem(seq.seq_id, tokens, seq.num_computed)


class LLMEngine(InProcessDriver):
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
            self.runner, self.spec, config, self.counters, chunk_store, max_len=context
        )
        # Reused KV is attached when a sequence is admitted to its first step.
        self.scheduler = Scheduler(config.scheduler, admit=self._admit)
        self.completions = Completions()  # requests with n > 1 or best_of > 1
        self.window, self.slide_kv = self._slide_policy(config, context)
        self._slides_due: list[Sequence] = []  # reached the window this step
        # Aliases read by the engine process and tests; ``remote`` also carries
        # the session records.
        self.remote = self.kv_reuse.remote
        self.prefix_index = self.kv_reuse.prefix_index
        # The model's unscoped namespace: a request's chunk keys are those of
        # KvReuse.namespace_of (scoped by principal and cache_salt).
        self.namespace = self.kv_reuse.namespace
        self.chunk_size = self.kv_reuse.chunk_size
        self.speculation: Speculation | None = None  # set below; sessions report to it
        self.sessions = SessionTable(
            config.sessions.max_sessions,
            config.sessions.idle_ttl_s,
            persistent=self.remote is not None,
            on_forget=self._forget_session,
        )
        self.session_calls = SessionCalls(
            self.sessions,
            self.remote,
            self.abort,
            vocab_size=self.vocab_size,
            timeout_s=self._kvstore_timeout_s,
            counters=self.counters,
            max_fetches=config.sessions.max_record_fetches,
            record_wait_s=config.kvstore.record_wait_s if config.kvstore else 0.0,
        )
        self.restores = self.session_calls.restores
        # Final outputs of session turns wait for their record to land in the kvstore.
        self._held: HeldOutputs[RequestOutput] | None = (
            HeldOutputs(self.remote, config.kvstore.record_wait_s)
            if self.remote is not None and config.kvstore
            else None
        )
        self._requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs due at the next step
        # Session turns waiting for their record (``_pending`` is swapped each step).
        self._parked = ParkedRequests(lambda out: self._pending.append(out))
        # Requests waiting for their constraint to compile (Guidance.compile).
        self._compiling: list[tuple[Sequence, Future[Any]]] = []
        self.last_step_idle = False  # the last step computed nothing (waiting on I/O)
        self.guidance = Guidance(
            self.tokenizer.inner,
            self.vocab_size,
            self.spec.eos_token_ids,
            max_constraint_bytes=config.limits.max_constraint_bytes,
        )
        self.token_text = self.tokenizer.token_text  # token id -> its text (stop tokens, logprobs)
        self.picker = TokenPicker(
            self.spec.sampling_defaults,
            self.token_text,
            self.guidance,
            TokenTexts(self.tokenizer.inner, self.vocab_size),
        )
        self.speculation = (
            Speculation(config.speculation, self.runner, self.counters, self._draft_model(config))
            if config.speculation.num_tokens
            else None
        )

    def _draft_model(self, config: EngineConfig) -> DraftModel | None:
        """The draft model's proposer (``--draft-model``): its own runner, with
        as many slots as the target's; refused unless its vocabulary is the
        target's, id for id and string for string."""
        spec = config.speculation
        if spec.draft_model is None or spec.resolved_mode not in ("draft", "auto"):
            return None
        draft_spec = load_model_spec(spec.draft_model)
        mismatch = vocabulary_mismatch(
            self.tokenizer, Tokenizer.from_dir(draft_spec.path, draft_spec)
        )
        if mismatch is not None:
            raise ValueError(f"draft_model {spec.draft_model}: {mismatch}")
        # The draft guesses only while a sequence fits its context (and, for a
        # static-cache graph, its fixed KV capacity); past that the sequence
        # decodes without it.
        max_len = min(
            self.context_length,
            draft_spec.context_length or self.context_length,
            (draft_spec.static_cache.capacity if draft_spec.static_cache else None)
            or self.context_length,
        )
        runner = create_runner(
            draft_spec, config.runner, max_slots=config.scheduler.max_num_seqs, max_len=max_len
        )
        return DraftModel(
            runner,
            model_id=draft_spec.model_id,
            num_tokens=spec.num_tokens,
            target_vocab=self.vocab_size,
            draft_vocab=draft_spec.vocab_size,
            max_len=max_len,
            catchup_tokens=config.scheduler.max_num_batched_tokens,
            parked_bytes=config.sessions.max_parked_kv_bytes,
            pick=self.picker.guess_after,
            min_confidence=spec.min_confidence,
        )

    def _slide_policy(self, config: EngineConfig, window: int) -> tuple[SlidePolicy | None, str]:
        """The window's slide and how it moves KV ("rotate" or "recompute");
        no policy when the window is too small to slide and no one asked to."""
        ctx = config.context
        if ctx.slide_kv == "rotate" and self.runner.rope is None:
            raise ValueError(
                "context_slide_kv: rotate needs a graph whose GroupQueryAttention applies "
                "RoPE from its own tables; this one does not (use recompute or auto)"
            )
        how = (
            "rotate"
            if ctx.slide_kv != "recompute" and self.runner.rope is not None
            else ("recompute")
        )
        try:
            policy = SlidePolicy.make(
                window, ctx.sink_tokens, ctx.slide_tokens, config.cache.chunk_size
            )
        except ValueError:
            if ctx.overflow == "slide" or ctx.slide_tokens is not None:
                raise
            return None, how
        return policy, how

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
            fim_supported=self.tokenizer.fim is not None,
            kv_chunk_size=self.chunk_size,
            attention_windows=self.spec.attention_windows,
            speculative_mode=self.speculation.mode if self.speculation else "",
            speculative_tokens=self.speculation.num_tokens if self.speculation else 0,
            draft_model_id=(
                self.speculation.draft.model_id
                if self.speculation and self.speculation.draft
                else ""
            ),
        )

    def add_request(self, request: GenerationRequest) -> None:
        """Validate and queue a request; raises a ``GenAIError`` if it cannot run.

        A turn of a session that is not in memory waits outside the scheduler
        for its record; if it then cannot run, its one output carries the error."""
        rid = request.request_id
        if rid in self._requests or rid in self._parked or self.completions.is_group(rid):
            raise InvalidArgument(f"request_id: {rid!r} is already in flight")
        validate_completions(request, self.config.limits)
        if max(request.n, request.best_of or 1) > 1:
            self._queue_completions(request)
            return
        if request.session_id is None:
            self._queue(request, None)
            return
        queued = self.session_calls.use(
            request.session_id, request.principal, lambda s: self._queue(request, s)
        )
        if isinstance(queued, PendingCall):
            # Turns parked for their session's record count toward the queue bound.
            waiting = self.scheduler.num_waiting + len(self._parked)
            if waiting >= self.config.scheduler.max_queue:
                queued.cancel()
                raise ResourceExhausted(
                    f"queue: {waiting} requests waiting, the limit is "
                    f"{self.config.scheduler.max_queue}; retry later"
                )
            self._parked.park(request, queued)

    def _queue_completions(self, request: GenerationRequest) -> None:
        """A request for several completions: its member requests (``Completions``),
        member 0 prefilling the prompt that the others then copy (``_admit``)."""
        members = self.completions.split(request)
        try:
            for member in members:
                leader = self._requests.get(members[0].request_id)
                self._queue(member, None, leader)
        except GenAIError:
            for member in members:
                if member.request_id in self._requests:
                    self._finish(
                        self._requests[member.request_id],
                        FinishReason.CANCELLED,
                        emit=False,
                        abort=True,
                    )
            self.completions.forget(request.request_id)
            raise

    def _queue(
        self, request: GenerationRequest, session: Session | None, leader: Sequence | None = None
    ) -> None:
        history = session.history if session is not None else []
        request, dropped = truncate_prompt(
            request, self.config.context.sink_tokens, session is not None
        )
        overflow = request.context_overflow or (
            session.context_overflow if session is not None else self.config.context.overflow
        )
        slide = overflow == "slide"
        if slide and self.window is None:
            raise InvalidArgument(
                f"context_overflow: slide is not possible in this server's "
                f"{self.context_length}-token context window"
            )
        validate_request(
            request,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            history_len=len(history),
            limits=self.config.limits,
            slide_sinks=self.window.sinks if slide and self.window else None,
        )
        if request.prompt_logprobs and not self.runner.can_verify:
            raise InvalidArgument(
                "prompt_logprobs: this model's graph returns only the last position's logits "
                "and has no num_logits_to_keep input"
            )
        # The turn's own constraint; the history never passes through it. A
        # grammar not in the cache compiles on the compiler thread while the
        # engine steps; its request waits outside the scheduler meanwhile.
        compiled = self.guidance.compile(request.constraint) if request.constraint else None
        matcher = None
        if compiled is not None and compiled.done():
            matcher = self.guidance.take(compiled)
        elif compiled is not None:
            waiting = self.scheduler.num_waiting + len(self._compiling)
            if waiting >= self.config.scheduler.max_queue:
                # The compile goes on (other requests may share it; it is cached).
                raise ResourceExhausted(
                    f"queue: {waiting} requests waiting, the limit is "
                    f"{self.config.scheduler.max_queue}; retry later"
                )
        if session is not None:
            self.sessions.begin_turn(session.session_id, request.request_id)
        try:
            seq = new_sequence(
                request,
                history,
                session,
                tokenizer=self.tokenizer.inner,
                eos_token_ids=self.spec.eos_token_ids,
                max_new_tokens=resolve_max_new_tokens(request, self.config.limits),
            )
            seq.matcher = matcher
            seq.leader = leader
            seq.dropped_tokens = dropped
            if request.prompt_logprobs:
                seq.prompt_logprobs = []
            seq.slide = slide
            if session is not None:
                seq.lineage = session.lineage
            if compiled is not None and matcher is None:
                self._compiling.append((seq, compiled))  # admitted by _admit_compiled
            else:
                self._schedule(seq)
        except GenAIError:
            if session is not None:
                self.sessions.end_turn(session)
            raise
        self._requests[request.request_id] = seq
        self.counters["requests_added"] += 1

    def _schedule(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        if seq.leader is None:  # (a completion's other members copy member 0's prompt KV)
            self.kv_reuse.start_prefetch(seq)

    def _admit(self, seq: Sequence) -> bool:
        """Before a sequence's first step: attach its reused KV (a completion's
        member: the prompt KV its member 0 computed), then slide a turn whose
        history and input pass the window."""
        leader = seq.leader
        if leader is not None:
            need = seq.prompt_len - 1  # its own step computes the last prompt token
            if leader.status is SeqStatus.RUNNING and leader.num_computed < need:
                return False  # member 0 is still prefilling the prompt
            seq.leader = None
            if (
                need > 0
                and leader.status is SeqStatus.RUNNING
                and self.runner.kv_len(leader.seq_id) >= need
            ):
                self.runner.write_kv(seq.seq_id, self.runner.read_kv(leader.seq_id, 0, need))
                seq.num_computed = need
                self.counters["completion_shared_prompt_tokens"] += need
                return True
            # member 0 is gone (finished, failed): the prefix cache, or a recompute
        if not self.kv_reuse.attach(seq):
            return False
        if seq.lineage and seq.num_computed <= min(self.config.context.sink_tokens, seq.prompt_len):
            seq.lineage = b""  # none of its moved KV came back: all is computed afresh
        if seq.slide and len(seq.token_ids) >= self.context_length:
            keep_from = len(seq.token_ids) - len(seq.request.prompt_token_ids)
            if (
                self.slide_kv == "rotate"
                and self.window
                and (self.window.sinks_for(keep_from) < seq.num_computed < keep_from)
            ):
                # The history's tail was computed before the slide where it ran
                # first: compute it so again, then slide (_slide_due).
                seq.hold_at = keep_from
            else:
                self._slide(seq, keep_from)
                seq.num_cached = min(seq.num_cached, seq.num_computed)
        return True

    def _slide(self, seq: Sequence, keep_from: int) -> None:
        """Drop the oldest tokens after the sinks (kv/window.py) from the context
        and the KV of ``seq``; its tokens from ``keep_from`` on stay."""
        assert self.window is not None  # only sliding sequences come here
        n = len(seq.token_ids)
        drop = self.window.drop_for(n, keep_from)
        start = self.window.sinks_for(keep_from)
        held = min(self.runner.kv_len(seq.seq_id), seq.num_computed)
        if self.slide_kv == "rotate" and held > start + drop:
            self.runner.shift(seq.seq_id, start, drop)
            seq.num_computed = held - drop
            seq.lineage = next_lineage(seq.lineage, seq.token_ids, start, drop)  # before the drop
        else:
            # Recompute what is kept after the sinks (their KV never changes).
            if held > start:
                self.runner.truncate(seq.seq_id, start)
            seq.num_computed = min(held, start)
            seq.lineage = b""
        seq.drop(start, drop)
        if self.speculation is not None:
            self.speculation.forget(seq.seq_id)  # its n-gram index is of the old context
        kept_chunks = start // self.chunk_size if not seq.lineage else 0
        self.kv_reuse.after_slide(seq, kept_chunks)
        self.counters["context_slides"] += 1
        self.counters["context_dropped_tokens"] += drop

    def _admit_compiled(self) -> None:
        """Schedule the requests whose constraint has compiled; fail those
        whose constraint did not (an aborted one is gone already)."""
        if not any(compiled.done() for _, compiled in self._compiling):
            return
        still: list[tuple[Sequence, Future[Any]]] = []
        for seq, compiled in self._compiling:
            if not compiled.done():
                still.append((seq, compiled))
            elif seq.status is not SeqStatus.FINISHED:
                try:
                    seq.matcher = self.guidance.take(compiled)
                    self._schedule(seq)
                except GenAIError as error:
                    self._fail(seq, error)
        self._compiling = still

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its final output (``CANCELLED``) comes from the next step."""
        if self._parked.cancel(request_id):
            self.counters["requests_aborted"] += 1
            return True
        if self.completions.is_group(request_id):
            return any([self.abort(m) for m in self.completions.members(request_id)])
        seq = self._requests.get(request_id)
        if seq is None or seq.status in (SeqStatus.FINISHED, SeqStatus.COMMITTING):
            return False
        self._finish(seq, FinishReason.CANCELLED, emit=True, abort=True)
        self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return (
            bool(
                self._pending
                or self._held
                or self.session_calls.holding
                or self.kv_reuse.finished
                or self.restores
                or self._compiling
            )
            or self.scheduler.has_work()
        )

    def close(self) -> None:
        """Share finished sequences' chunks, then release background resources
        (the kvstore connector, after its pushes have gone out)."""
        self.flush_finished()
        self.guidance.close()
        if self.remote is not None:
            self.remote.flush(self._kvstore_timeout_s)
            self.remote.close()

    def stats(self) -> dict[str, int]:
        """Counters and gauges for the frontend's /metrics."""
        return {
            **self.counters,
            "waiting": self.scheduler.num_waiting,
            "running": len(self.scheduler.running),
            # KV held in the runner's slots, against what they can hold (/metrics' usage).
            "kv_cache_tokens": sum(seq.num_computed for seq in self.scheduler.running),
            "kv_cache_capacity_tokens": self.config.scheduler.max_num_seqs * self.context_length,
            "sessions": len(self.sessions),
            "prefix_cache_bytes": self.prefix_index.bytes_used,
            "prefix_cache_entries": len(self.prefix_index),
            "sessions_evicted": self.sessions.evicted,
            "sessions_replaced": self.sessions.replaced,  # stale copies, newer record
            **{f"kvstore_{k}": v for k, v in (self.remote.stats() if self.remote else {}).items()},
        }

    @property
    def _kvstore_timeout_s(self) -> float:
        return self.config.kvstore.timeout_s if self.config.kvstore else 1.0

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if not self.completions.active:
            return outputs
        outputs, abort = self.completions.relabel(outputs)
        for member in abort:  # the rest of a group one of whose members failed
            seq = self._requests.get(member)
            if seq is not None and seq.status not in (SeqStatus.FINISHED, SeqStatus.COMMITTING):
                self._finish(seq, FinishReason.CANCELLED, emit=False, abort=True)
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, stored = self._housekeeping()
        batch = self.scheduler.schedule()
        self.last_step_idle = not batch and not stored
        if not batch:
            return outputs
        started = time.perf_counter()
        computed = self._run(batch)
        produced = self._postprocess(computed)
        spec = self.speculation
        if spec is not None and spec.measuring and (computed.plain or computed.verified):
            # The batch rule's measurement (not of a step whose runner failed).
            spec.observe(sum(len(o.token_ids) for o in produced), time.perf_counter() - started)
        outputs += produced
        if self._slides_due:
            self._slide_due()
        return outputs + self._drain_pending()

    # sessions: the calls that take a session id answer a ``PendingCall`` when
    # the session must first come from its kvstore record (``SessionCalls``).

    def create_session(
        self,
        idle_ttl_s: float | None = None,
        owner: str = "",
        metadata: dict[str, str] | None = None,
        context_overflow: str | None = None,
    ) -> SessionInfo | PendingCall:
        overflow = context_overflow or self.config.context.overflow
        if overflow == "slide" and self.window is None:
            raise InvalidArgument(
                f"context_overflow: slide is not possible in this server's "
                f"{self.context_length}-token context window"
            )
        return self.session_calls.create(idle_ttl_s, owner, metadata, overflow)

    def get_session(self, session_id: str, principal: str = "") -> SessionInfo | PendingCall:
        return self.session_calls.get(session_id, principal)

    def reset_session(self, session_id: str, principal: str = "") -> SessionInfo | PendingCall:
        return self.session_calls.reset(session_id, principal)

    def rewind_session(
        self,
        session_id: str,
        principal: str = "",
        turns: int | None = None,
        history_tokens: int | None = None,
    ) -> SessionInfo | PendingCall:
        return self.session_calls.rewind(session_id, principal, turns, history_tokens)

    def fork_session(
        self,
        session_id: str,
        principal: str = "",
        turns: int | None = None,
        idle_ttl_s: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> SessionInfo | PendingCall:
        return self.session_calls.fork(session_id, principal, turns, idle_ttl_s, metadata)

    def close_session(self, session_id: str, principal: str = "") -> SessionInfo | PendingCall:
        return self.session_calls.close(session_id, principal)

    def list_sessions(
        self, principal: str = "", page_size: int = 0, page_token: str = ""
    ) -> SessionPage:
        return self.session_calls.page(principal, page_size, page_token)

    # -- internals ---------------------------------------------------------------

    def _housekeeping(self) -> tuple[list[RequestOutput], int]:
        """Before a step: resume calls and requests whose session record
        arrived, take the outputs due, share finished sequences' chunks (how
        many were copied is returned too) and retire requests past their
        time limit."""
        if self.restores:
            self.restores.poll()
        if self._compiling:
            self._admit_compiled()
        outputs, self._pending = self._pending, []
        if self._held is not None:
            outputs.extend(self._held.release())
        self.session_calls.release_answers()
        stored = self._store_finished()
        self._expire()
        return outputs, stored

    def _run(self, batch: ScheduledBatch) -> _Computed:
        """Compute ``batch``: sequences with a speculative draft verify it, the
        others run as one step. A runner failure fails the batch's requests."""
        spec = self.speculation
        drafts = spec.drafts(batch.items, self.context_length) if spec else {}
        plain = [item for item in batch.items if item[0].seq_id not in drafts]
        items = [
            _step_item(seq, seq.token_ids[seq.num_computed : seq.num_computed + n])
            for seq, n in plain
        ]
        # Prefill chunks of prompt_logprobs requests: every position's logits.
        wide = [
            i
            for i, (seq, _) in enumerate(plain)
            if seq.prompt_logprobs is not None and seq.num_computed < seq.prompt_len
        ]
        # Masks of the rows that pick a token after this step, filled meanwhile.
        masks = self.guidance.start_step(
            [
                s
                for s, n in plain
                if s.status is SeqStatus.RUNNING and s.num_computed + n == len(s.token_ids)
            ]
        )
        try:
            checked = [(seq, drafts[seq.seq_id]) for seq, _ in batch.items if seq.seq_id in drafts]
            # The last token and the draft, in one step: [len(draft) + 1, vocab] logits each.
            checks = [_step_item(seq, (seq.token_ids[-1], *d.tokens)) for seq, d in checked]
            # A speculating step's other sequences (one-token decodes: ``drafts``
            # drafts only such steps) ride in the same call where the runner
            # checks several sequences in one: one ORT call, not two.
            ride = bool(checks) and bool(items) and not wide and self.runner.checks_in_one_call
            rows = self.runner.verify_batch(checks + items if ride else checks)
            verified = [
                (seq, d, r) for (seq, d), r in zip(checked, rows[: len(checks)], strict=True)
            ]
            logits: np.ndarray | None = None
            if ride:
                logits = np.stack([r[-1] for r in rows[len(checks) :]])
            elif wide:
                logits = self._run_wide(plain, items, wide)
            elif items:
                logits = self.runner.run(items)
        except Exception as exc:  # an ORT failure must not take the engine down
            log.exception("runner_failed", batch=[s.request_id for s, _ in batch.items])
            for seq, _ in batch.items:
                self._fail(seq, Internal(f"model runner failed: {exc}"))
            return _Computed([])
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += batch.num_tokens + sum(
            len(d.tokens) for d in drafts.values()
        )
        return _Computed(plain, logits, verified, masks)

    def _run_wide(
        self, plain: list[tuple[Sequence, int]], items: list[StepItem], wide: list[int]
    ) -> np.ndarray:
        """``runner.run(items)``, but the items ``wide`` (prefill chunks of
        prompt_logprobs requests) run one by one with every position's logits
        (``runner.verify``), which give their prompt logprobs; each item's row
        is its last position's logits, as ``run`` gives."""
        skip = set(wide)
        rest = [i for i in range(len(items)) if i not in skip]
        logits = np.empty((len(items), self.vocab_size), dtype=np.float32)
        if rest:
            logits[rest] = self.runner.run([items[i] for i in rest])
        for i in wide:
            seq, n = plain[i]
            rows = self.runner.verify(items[i])  # [n, vocab]
            start = seq.num_computed
            # Position p's row predicts token p + 1, a prompt token while p + 1 < prompt_len.
            targets = seq.token_ids[start + 1 : min(start + n + 1, seq.prompt_len)]
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs.extend(
                prompt_logprobs(
                    rows[: len(targets)], targets, seq.request.prompt_logprobs, self.token_text
                )
            )
            logits[i] = rows[-1]
        return logits

    def _postprocess(self, computed: _Computed) -> list[RequestOutput]:
        """Pick the next tokens from what ``_run`` computed and append them."""
        outputs = []
        spec = self.speculation
        for seq, draft, rows in computed.verified:
            assert spec is not None  # only it drafts
            outputs.append(spec.accept(seq, draft, rows, self.picker, self._append_token))
        if computed.logits is None:
            return outputs
        to_sample: list[int] = []
        for i, (seq, n) in enumerate(computed.plain):
            seq.num_computed += n
            if seq.hold_at is not None and seq.num_computed >= seq.hold_at:
                self._slides_due.append(seq)  # its held history is computed
            if seq.status is SeqStatus.COMMITTING:
                self._park_session(seq)
            elif seq.num_pending == 0:
                to_sample.append(i)
                if not seq.output_ids:
                    self.kv_reuse.track(seq)  # prompt done: its chunks are shareable
        if not to_sample:
            return outputs
        seqs = [computed.plain[i][0] for i in to_sample]
        logits = computed.logits
        if len(to_sample) < len(logits):
            logits = logits[to_sample]  # a copy: only when some rows are not sampled
        masks = computed.masks.result() if computed.masks is not None else None
        picks = self.picker.pick(seqs, logits, masks)
        outputs.extend(self._append_token(seq, *p) for seq, p in zip(seqs, picks, strict=True))
        return outputs

    def _slide_due(self) -> None:
        """Slide the sequences that reached the window this step (still running)."""
        due, self._slides_due = self._slides_due, []
        for seq in due:
            if seq.status is not SeqStatus.RUNNING:
                continue
            if seq.hold_at is not None:
                keep_from, seq.hold_at = seq.hold_at, None
                self._slide(seq, keep_from)
                seq.num_cached = min(seq.num_cached, seq.num_computed)
            elif len(seq.token_ids) >= self.context_length:
                self._slide(seq, keep_from=len(seq.token_ids) - 1)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> RequestOutput:
        """Append a picked token; apply the stop rules; the token's output."""
        try:
            text, finish = seq.append(
                token, self.context_length, self.token_text, self.guidance.consume
            )
        except GenAIError as error:  # its constraint's matcher broke: fail this request
            self._fail(seq, error)
            return RequestOutput(seq.request_id)
        delta = RequestOutput(seq.request_id, (token,), text, (lp,) if lp else ())
        if seq.prompt_logprobs is not None:  # its first output carries them
            delta = dataclasses.replace(delta, prompt_logprobs=tuple(seq.prompt_logprobs))
            seq.prompt_logprobs = None
        if finish is None:
            if seq.slide and len(seq.token_ids) >= self.context_length:
                self._slides_due.append(seq)  # after the step's tokens are all in
            return delta
        final = self._finish(seq, finish, emit=False)
        if seq.session is not None and self._held is not None:
            # Answer only once the session record is visible to other replicas,
            # so the next turn may go to any of them.
            self._held.hold(self.session_calls.record_key(seq.session.session_id), final)
            return delta
        return merge_outputs(delta, final)

    def _finish(
        self, seq: Sequence, reason: FinishReason, *, emit: bool, abort: bool = False
    ) -> RequestOutput:
        """Retire a request: free or park its KV, end its session turn, build its final output."""
        seq.finish_reason = reason
        self._requests.pop(seq.request_id, None)
        session = seq.session
        commit = False
        if session is not None:
            if abort and seq.status is SeqStatus.RUNNING:
                self.kv_reuse.keep_history(seq, session)
            elif not abort:
                session.history = list(seq.token_ids)
                session.turns += 1
                if seq.slides:  # its context slid: earlier turn ends moved or are gone
                    session.turn_ends = slide_turn_ends(session.turn_ends, seq.slides)
                    session.dropped_tokens += sum(n for _, n in seq.slides)
                session.lineage = seq.lineage
                if seq.mirostat is not None:
                    session.mirostat_mu = seq.mirostat.mu
                session.turn_ends.append(len(session.history))
                self.session_calls.save(session)
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
        out = seq.final_output()
        if emit:
            self._pending.append(out)
        return out

    def _store_finished(self, *, all_now: bool = False) -> int:
        """Share the chunks of sequences that finished in earlier steps, a few
        per step while others run, and free as many slots as waiting requests
        need now (``KvReuse.store_finished``). Returns the chunks copied."""
        scheduler, finished = self.scheduler, len(self.kv_reuse.finished)
        if not finished:
            return 0  # the common step
        # Slots the waiting requests could take that only finished sequences hold.
        free = self.config.scheduler.max_num_seqs - len(scheduler.running) - finished
        must_free = min(finished, scheduler.num_waiting - free)
        return self.kv_reuse.store_finished(must_free, scheduler.has_work() and not all_now)

    def flush_finished(self) -> None:
        """Share every finished sequence's chunks and free their slots now."""
        self._store_finished(all_now=True)

    def _retire(self, seq: Sequence) -> None:
        shareable = seq.status is SeqStatus.RUNNING or seq.status is SeqStatus.COMMITTING
        seq.status = SeqStatus.FINISHED
        if self.speculation is not None:
            session = seq.session
            if (
                shareable
                and session is not None
                and self.sessions.find(session.session_id) is session
            ):
                self.speculation.park(seq)  # the draft's KV, for the session's next turn
            else:
                self.speculation.forget(seq.seq_id)
        self.scheduler.remove(seq)
        self.kv_reuse.retire(seq, shareable)

    def _forget_session(self, session_id: str) -> None:
        """A session was reset, closed or dropped from memory: so is its draft KV."""
        if self.speculation is not None and self.speculation.draft is not None:
            self.speculation.draft.forget_session(session_id)

    def _park_session(self, seq: Sequence) -> None:
        """A session turn's last token is computed: park its KV with the session."""
        session = seq.session
        assert session is not None  # only session sequences commit
        if session.session_id in self.sessions:
            self.kv_reuse.park(seq, session)
        session.committing = False
        for heir in session.take_heirs():
            if self.sessions.find(heir.session_id) is heir:
                self.kv_reuse.bequeath(seq, session, heir)
        self._retire(seq)
        dropped = self.sessions.trim_parked_kv(self.config.sessions.max_parked_kv_bytes)
        self.counters["session_kv_evicted"] += dropped

    def _fail(self, seq: Sequence, error: GenAIError) -> None:
        if seq.status is SeqStatus.COMMITTING:
            if seq.session is not None:
                seq.session.committing = False
                seq.session.take_heirs()  # their first turns recompute it
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
        compiling = [seq for seq, _ in self._compiling if seq.status is not SeqStatus.FINISHED]
        for seq in [*self.scheduler.waiting(), *compiling]:
            if seq.deadline is not None and now >= seq.deadline:
                self._finish(seq, FinishReason.TIME_LIMIT, emit=True, abort=True)
        self.sessions.expire_idle()

    def _drain_pending(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out
