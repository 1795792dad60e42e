"""Requests for several completions (``n`` > 1 or ``best_of`` > 1): one member
sequence per completion, their outputs relabelled as the request's
(docs/design.md, "Several completions").

``Completions.split`` turns such a request into ``best_of`` member requests
(ids ``<id>\\x1f<i>``, completion i sampling with seed + i); the engine
prefills the prompt once, for member 0, and copies that KV to the others
(``LLMEngine._admit``). ``relabel`` maps the members' outputs back onto the
request: each gets ``index`` i and ``finished`` False; the request's last
output (``index`` -1, ``finished`` True) carries the usage (the prompt once,
every member's tokens) once every member is done. With ``best_of`` > ``n``
nothing streams: the members' outputs are held until all are done, then the
``n`` with the highest cumulative logprob come out as indexes 0..n-1.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from ...contract.request import GenerationRequest, RequestOutput, Usage, merge_outputs

SEPARATOR = "\x1f"  # member ids: request id, separator, index
GROUP_END = -1  # RequestOutput.index of a group's last output


@dataclass
class Group:
    request: GenerationRequest
    members: list[str]
    seed: int
    held: dict[int, list[RequestOutput]] = field(default_factory=dict)  # best_of > n
    done: dict[int, RequestOutput] = field(default_factory=dict)  # index -> final output
    failed: bool = False

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def streams(self) -> bool:
        return len(self.members) == self.n


class Completions:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self._member: dict[str, tuple[str, int]] = {}  # member id -> (request id, index)

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def is_group(self, request_id: str) -> bool:
        return request_id in self.groups

    def split(self, request: GenerationRequest) -> list[GenerationRequest]:
        """The member requests of a request for several completions; member 0
        first (it prefills the prompt)."""
        rid = request.request_id
        seed = request.sampling.seed
        if seed is None:
            seed = secrets.randbits(63)
        count = request.best_of or request.n
        # best_of > n ranks by cumulative logprob: every member returns its
        # tokens' logprobs (cut from the answer unless asked).
        top = request.top_logprobs or (1 if count > request.n else 0)
        members = [
            dataclasses.replace(
                request,
                request_id=f"{rid}{SEPARATOR}{i}",
                n=1,
                best_of=None,
                top_logprobs=top,
                sampling=dataclasses.replace(request.sampling, seed=(seed + i) % 2**64),
            )
            for i in range(count)
        ]
        self.groups[rid] = Group(request, [m.request_id for m in members], seed)
        for i, m in enumerate(members):
            self._member[m.request_id] = (rid, i)
        return members

    def members(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return list(group.members) if group is not None else []

    def forget(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        for m in group.members if group is not None else ():
            self._member.pop(m, None)

    def relabel(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The members' outputs as their request's, and the members to abort
        (the rest of a group one of whose members failed)."""
        out: list[RequestOutput] = []
        abort: list[str] = []
        for o in outputs:
            found = self._member.get(o.request_id)
            if found is None:
                out.append(o)
                continue
            rid, i = found
            group = self.groups[rid]
            if group.failed:
                continue
            if o.error is not None:
                group.failed = True
                out.append(RequestOutput(rid, finished=True, error=o.error))
                abort += [m for j, m in enumerate(group.members) if j not in group.done and j != i]
                self.forget(rid)
                continue
            if group.streams:
                out.append(self._streamed(group, rid, i, o))
            else:
                group.held.setdefault(i, []).append(o)
            if o.finished:
                group.done[i] = o
                if len(group.done) == len(group.members):
                    out += self._end(group, rid)
        return [o for o in out if o is not None], abort

    def _streamed(self, group: Group, rid: str, i: int, o: RequestOutput) -> RequestOutput:
        return dataclasses.replace(
            o, request_id=rid, index=i, finished=False, usage=None, session_id=None
        )

    def _end(self, group: Group, rid: str) -> list[RequestOutput]:
        """The group's last outputs: the held best ``n`` (best_of > n), then its end."""
        finals = group.done
        out: list[RequestOutput] = []
        if not group.streams:
            wanted = group.request.top_logprobs > 0

            def score(i: int) -> float:
                merged = merge_outputs(*group.held[i])
                return sum(lp.logprob for lp in merged.logprobs)

            best = sorted(range(len(group.members)), key=lambda i: (-score(i), i))[: group.n]
            for rank, i in enumerate(best):
                merged = merge_outputs(*group.held[i])
                out.append(
                    dataclasses.replace(
                        merged,
                        request_id=rid,
                        index=rank,
                        finished=False,
                        usage=None,
                        logprobs=merged.logprobs if wanted else (),
                    )
                )
        first = finals[0].usage or Usage()
        usage = dataclasses.replace(
            first,
            completion_tokens=sum((f.usage or Usage()).completion_tokens for f in finals.values()),
        )
        out.append(
            RequestOutput(
                rid,
                finished=True,
                finish_reason=finals[0].finish_reason,
                usage=usage,
                seed=group.seed,
                index=GROUP_END,
            )
        )
        self.forget(rid)
        return out
