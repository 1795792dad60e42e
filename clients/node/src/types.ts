/**
 * What the client returns, mirroring the Python client's genai_client/types.py
 * in camelCase: plain objects, enums as their short names ("MAX_TOKENS").
 */
import { ContextOverflow, FinishReason, type TokenLogprob, type ToolCall, type Usage } from "./gen/genai/v1/common";
import type { Delta as DeltaProto, Final, GenerateResponse } from "./gen/genai/v1/generate";
import { RunnerKind, SpeculativeMode, type ModelInfo as ModelInfoProto } from "./gen/genai/v1/model";
import type { Session as SessionProto } from "./gen/genai/v1/session";
import type { GenAIError } from "./errors";

export type { TokenLogprob, TopLogprob, ToolCall, Usage } from "./gen/genai/v1/common";
export type { KvLayout, Token } from "./gen/genai/v1/model";

/** Why a request stopped: FinishReason's name without its prefix. */
export type FinishReasonName =
  | "MAX_TOKENS"
  | "EOS_TOKEN"
  | "STOP_SEQUENCE"
  | "CONTEXT_LENGTH"
  | "TIME_LIMIT"
  | "CANCELLED"
  | "";

/** Output produced since the previous delta of a streamed request. */
export interface Delta {
  text: string;
  tokenIds: number[];
  logprobs: TokenLogprob[];
  /** The first delta of a request with `promptLogprobs`. */
  promptLogprobs: TokenLogprob[];
  /** n > 1: the completion these tokens belong to. */
  index: number;
}

/** One of the completions of a request with n > 1. */
export interface Completion {
  index: number;
  text: string;
  tokenIds: number[];
  finishReason: FinishReasonName;
  stopSequence: string;
  logprobs: TokenLogprob[];
  toolCalls: ToolCall[];
}

/** The whole result of a request (a stream's `text` is its deltas' text joined). */
export interface GenerationResult {
  text: string;
  tokenIds: number[];
  finishReason: FinishReasonName;
  stopSequence: string;
  logprobs: TokenLogprob[];
  usage: Usage;
  /** The seed the sampler used: send it back as `seed` to reproduce the output. */
  seed: bigint;
  /** The session this was a turn of; undefined for a stateless request. */
  sessionId: string | undefined;
  sessionTokens: number;
  requestId: string;
  toolCalls: ToolCall[];
  /** `promptLogprobs` asked: entry i is prompt token i + 1's (the first has none). */
  promptLogprobs: TokenLogprob[];
  /** n > 1: every completion (the fields above are completion 0's). */
  completions: Completion[];
}

/** One event of a bidi stream: a request's delta, its result, or its error. */
export interface BidiEvent {
  requestId: string;
  delta?: Delta;
  result?: GenerationResult;
  error?: GenAIError;
}

/** A server-side session's state. */
export interface SessionInfo {
  sessionId: string;
  createdAt: Date | undefined;
  lastUsedAt: Date | undefined;
  historyTokens: number;
  turns: number;
  idleTtlSeconds: number;
  busy: boolean;
  metadata: Record<string, string>;
  /** "error" or "slide": what its turns do at the context window. */
  contextOverflow: string;
  /** History the window's slides dropped since creation or the last reset. */
  droppedTokens: number;
}

/** The served model; `runnerKind` is RunnerKind's name without its prefix. */
/** The served model; `speculativeMode` is "" (off), "PROMPT_LOOKUP", "DRAFT" or "AUTO". */
export type ModelInfo = Omit<ModelInfoProto, "runnerKind" | "speculativeMode"> & {
  runnerKind: string;
  speculativeMode: string;
};

const PREFIX = "FINISH_REASON_";

/** FINISH_REASON_EOS_TOKEN -> "EOS_TOKEN"; unspecified -> "". A number this
 * client does not know (a newer server) is a TypeError, never a wrong name. */
export function finishReasonName(value: FinishReason): FinishReasonName {
  if (value === FinishReason.FINISH_REASON_UNSPECIFIED) return "";
  const name = FinishReason[value];
  if (name === undefined) throw new TypeError(`unknown finish_reason ${value}`);
  return name.slice(PREFIX.length) as FinishReasonName;
}

export function deltaFromProto(delta: DeltaProto): Delta {
  return {
    text: delta.text,
    tokenIds: delta.tokenIds,
    logprobs: delta.logprobs,
    promptLogprobs: delta.promptLogprobs,
    index: delta.index,
  };
}

const USAGE_ZERO: Usage = { promptTokens: 0, completionTokens: 0, cachedTokens: 0, droppedTokens: 0 };

export function resultFromProto(
  r: GenerateResponse | Final,
  text?: string,
  promptLogprobs?: TokenLogprob[],
  texts?: ReadonlyMap<number, string>,
): GenerationResult {
  return {
    text: text ?? (r as GenerateResponse).text,
    tokenIds: r.tokenIds,
    finishReason: finishReasonName(r.finishReason),
    stopSequence: r.stopSequence,
    logprobs: r.logprobs,
    usage: r.usage ?? { ...USAGE_ZERO },
    seed: r.seed,
    sessionId: r.sessionId || undefined,
    sessionTokens: r.sessionTokens,
    requestId: r.requestId,
    toolCalls: r.toolCalls,
    promptLogprobs: promptLogprobs ?? ("promptLogprobs" in r ? r.promptLogprobs : []),
    completions: r.completions.map((c) => ({
      index: c.index,
      text: texts?.get(c.index) ?? c.text,
      tokenIds: c.tokenIds,
      finishReason: finishReasonName(c.finishReason),
      stopSequence: c.stopSequence,
      logprobs: c.logprobs,
      toolCalls: c.toolCalls,
    })),
  };
}

export function sessionFromProto(s: SessionProto | undefined): SessionInfo {
  if (s === undefined) throw new TypeError("the server sent no session");
  return {
    sessionId: s.sessionId,
    createdAt: s.createdAt,
    lastUsedAt: s.lastUsedAt,
    historyTokens: s.historyTokens,
    turns: s.turns,
    idleTtlSeconds: s.idleTtlSeconds,
    busy: s.busy,
    metadata: { ...s.metadata },
    contextOverflow: s.contextOverflow === ContextOverflow.CONTEXT_OVERFLOW_SLIDE ? "slide" : "error",
    droppedTokens: Number(s.droppedTokens),
  };
}

export function modelInfoFromProto(m: ModelInfoProto | undefined): ModelInfo {
  if (m === undefined) throw new TypeError("the server sent no model_info");
  const kind = RunnerKind[m.runnerKind] ?? String(m.runnerKind);
  const mode = SpeculativeMode[m.speculativeMode] ?? String(m.speculativeMode);
  return {
    ...m,
    runnerKind: kind.replace(/^RUNNER_KIND_/, ""),
    speculativeMode: mode === "SPECULATIVE_MODE_UNSPECIFIED" ? "" : mode.replace(/^SPECULATIVE_MODE_/, ""),
  };
}
