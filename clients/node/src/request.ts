/**
 * Building a GenerateRequest from the client's options, as the Python
 * client's genai_client/_request.py does from its keyword options. Options
 * are camelCase; an option name the client does not know (a snake_case
 * spelling, a typo) is a TypeError rather than a field silently dropped, and
 * an enum given by a name it does not know is a TypeError rather than 0.
 */
import { ChatMessage, ContextOverflow, Messages, Priority, ToolCall } from "./gen/genai/v1/common";
import { Constraint, FimMode, GenerateRequest, Tool } from "./gen/genai/v1/generate";

/** A chat message: an object with role and content (name, toolCallId,
 * toolCalls optional), or a [role, content] pair. */
export type MessageLike =
  | { role: string; content: string; name?: string; toolCallId?: string; toolCalls?: readonly ToolCallLike[] }
  | readonly [string, string];

/** A tool call as returned in a result, or OpenAI's
 * `{id, type: "function", function: {name, arguments}}` form. */
export type ToolCallLike =
  | { id?: string; name: string; argumentsJson: string }
  | { id?: string; type?: string; function: { name: string; arguments: string | object } };

/** A tool the model may call: `parameters` is a JSON Schema (object or
 * text); OpenAI's `{type: "function", function: {...}}` form is accepted. */
export type ToolLike =
  | { name: string; description?: string; parameters?: object | string }
  | { type?: string; function: { name: string; description?: string; parameters?: object | string } };

/** Options of every generate call (`generate`, `stream`, `bidi().start`, and
 * the same on sessions). Unset fields take the server's defaults; see
 * protos/genai/v1/generate.proto for exact semantics. */
export interface GenerateOptions {
  /** Input (exactly one of prompt, tokenIds, messages). */
  prompt?: string;
  tokenIds?: readonly number[];
  messages?: readonly MessageLike[];
  /** Fill in between `prefix` and `suffix` (the model needs FIM tokens,
   * `ModelInfo.fimSupported`); mode "psm" (default) or "spm". */
  fim?: { prefix?: string; suffix?: string; mode?: "psm" | "spm" };
  /** Make the request a turn of this session (also sent as `x-session-id`). */
  sessionId?: string;
  // sampling
  temperature?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  repetitionPenalty?: number;
  frequencyPenalty?: number;
  presencePenalty?: number;
  seed?: number | bigint;
  // the rest of the decoding surface (generate.proto's SamplingParams)
  repetitionPenaltyLastN?: number;
  typicalP?: number;
  topA?: number;
  xtcThreshold?: number;
  xtcProbability?: number;
  dryMultiplier?: number;
  dryBase?: number;
  dryAllowedLength?: number;
  dryPenaltyLastN?: number;
  drySequenceBreakers?: readonly string[];
  /** 2: Mirostat v2. */
  mirostat?: number;
  mirostatTau?: number;
  mirostatEta?: number;
  /** Token id -> bias added to its logit, in [-100, 100]. */
  logitBias?: Readonly<Record<number, number>> | ReadonlyMap<number, number>;
  bannedTokenIds?: readonly number[];
  allowedTokenIds?: readonly number[];
  badWords?: readonly string[];
  // stopping
  maxNewTokens?: number;
  minNewTokens?: number;
  /** A stop sequence, or several. */
  stop?: string | readonly string[];
  stopTokenIds?: readonly number[];
  ignoreEos?: boolean;
  includeStopSequence?: boolean;
  timeLimitMs?: number;
  // other
  /** N alternatives per token; 0: no logprobs. */
  topLogprobs?: number;
  /** N alternatives per prompt token: every prompt token's logprob (but the first's). */
  promptLogprobs?: number;
  /** Completions to return (result.completions, delta.index); bestOf >= n generates more. */
  n?: number;
  bestOf?: number;
  priority?: "low" | "normal" | "high";
  addSpecialTokens?: boolean;
  skipSpecialTokens?: boolean;
  requestId?: string;
  cacheSalt?: string;
  /** A longer prompt keeps its first sink tokens and its last ones, this many in all. */
  truncatePromptTokens?: number;
  /** With messages: more variables for the model's chat template, e.g.
   * { enable_thinking: false } for Qwen3 (sent as JSON). */
  chatTemplateKwargs?: Record<string, unknown>;
  /** At the context window: "error" stops, "slide" drops the oldest tokens
   * after the sink tokens and goes on; unset: the session's or server's default. */
  contextOverflow?: "error" | "slide";
  // structured output (at most one)
  jsonSchema?: object | string;
  regex?: string;
  grammar?: string;
  choice?: readonly string[];
  jsonObject?: boolean;
  // tools (with messages)
  tools?: readonly ToolLike[];
  /** "auto", "none", "required" or a tool's name. */
  toolChoice?: string;
}

const OPTION_NAMES: ReadonlySet<string> = new Set([
  "prompt", "tokenIds", "messages", "fim", "sessionId", "temperature", "topK", "topP", "minP",
  "repetitionPenalty", "frequencyPenalty", "presencePenalty", "seed",
  "repetitionPenaltyLastN", "typicalP", "topA", "xtcThreshold", "xtcProbability", "dryMultiplier",
  "dryBase", "dryAllowedLength", "dryPenaltyLastN", "drySequenceBreakers", "mirostat", "mirostatTau",
  "mirostatEta", "logitBias", "bannedTokenIds", "allowedTokenIds", "badWords", "maxNewTokens",
  "minNewTokens", "stop", "stopTokenIds", "ignoreEos", "includeStopSequence", "timeLimitMs",
  "topLogprobs", "promptLogprobs", "n", "bestOf", "priority", "addSpecialTokens", "skipSpecialTokens", "requestId", "cacheSalt",
  "truncatePromptTokens", "chatTemplateKwargs", "contextOverflow", "jsonSchema", "regex", "grammar", "choice", "jsonObject", "tools", "toolChoice",
] satisfies (keyof GenerateOptions)[]);

const camel = (name: string): string => name.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());

/** Throws a TypeError naming every key of `options` not in `known`. */
export function checkOptionNames(options: object, known: ReadonlySet<string>, what: string): void {
  const unknown = Object.keys(options).filter((k) => !known.has(k));
  if (unknown.length === 0) return;
  const hints = unknown.map((k) => (known.has(camel(k)) ? `${k} (did you mean ${camel(k)}?)` : k));
  throw new TypeError(`unknown ${what} option(s): ${hints.join(", ")}`);
}

const PRIORITIES: Record<string, Priority> = {
  low: Priority.PRIORITY_LOW,
  normal: Priority.PRIORITY_NORMAL,
  high: Priority.PRIORITY_HIGH,
};

/** "low" | "normal" | "high" (or "PRIORITY_HIGH") to the enum; anything else
 * is a TypeError, never PRIORITY_UNSPECIFIED. */
export function priorityValue(priority: string | undefined): Priority {
  if (priority === undefined) return Priority.PRIORITY_UNSPECIFIED;
  const value = PRIORITIES[String(priority).toLowerCase().replace(/^priority_/, "")];
  if (value === undefined) {
    throw new TypeError(`priority ${JSON.stringify(priority)} is not one of "low", "normal", "high"`);
  }
  return value;
}

/** "error" | "slide" (or "CONTEXT_OVERFLOW_SLIDE") to the enum; anything else is a TypeError. */
export function contextOverflowValue(mode: string | undefined): ContextOverflow {
  if (mode === undefined) return ContextOverflow.CONTEXT_OVERFLOW_UNSPECIFIED;
  const name = String(mode).toLowerCase().replace(/^context_overflow_/, "");
  if (name === "error") return ContextOverflow.CONTEXT_OVERFLOW_ERROR;
  if (name === "slide") return ContextOverflow.CONTEXT_OVERFLOW_SLIDE;
  throw new TypeError(`contextOverflow ${JSON.stringify(mode)} is not one of "error", "slide"`);
}

function toolCall(call: ToolCallLike): ToolCall {
  if ("function" in call) {
    const args = call.function.arguments;
    return ToolCall.fromPartial({
      id: call.id ?? "",
      name: call.function.name,
      argumentsJson: typeof args === "string" ? args : JSON.stringify(args),
    });
  }
  return ToolCall.fromPartial({ id: call.id ?? "", name: call.name, argumentsJson: call.argumentsJson });
}

function chatMessage(message: MessageLike): ChatMessage {
  if (Array.isArray(message)) {
    const [role, content] = message as readonly [string, string];
    return ChatMessage.fromPartial({ role, content });
  }
  const m = message as Exclude<MessageLike, readonly [string, string]>;
  return ChatMessage.fromPartial({
    role: m.role,
    content: m.content,
    name: m.name ?? "",
    toolCallId: m.toolCallId ?? "",
    toolCalls: (m.toolCalls ?? []).map(toolCall),
  });
}

/** Chat messages as the proto's Messages. */
export function messagesProto(messages: readonly MessageLike[]): Messages {
  return { messages: messages.map(chatMessage) };
}

function toolProto(tool: ToolLike): Tool {
  const spec = "function" in tool ? tool.function : tool;
  const parameters = spec.parameters;
  return {
    name: spec.name,
    description: spec.description ?? "",
    parametersJsonSchema:
      parameters === undefined ? "" : typeof parameters === "string" ? parameters : JSON.stringify(parameters),
  };
}

function constraintProto(o: GenerateOptions): Constraint | undefined {
  const given = (["jsonSchema", "regex", "grammar", "choice", "jsonObject"] as const).filter(
    (k) => o[k] !== undefined && o[k] !== false,
  );
  if (given.length === 0) return undefined;
  if (given.length > 1) throw new TypeError(`give at most one constraint (got ${given.join(", ")})`);
  if (o.jsonSchema !== undefined) {
    return { jsonSchema: typeof o.jsonSchema === "string" ? o.jsonSchema : JSON.stringify(o.jsonSchema) };
  }
  if (o.regex !== undefined) return { regex: o.regex };
  if (o.grammar !== undefined) return { grammar: o.grammar };
  if (o.choice !== undefined) {
    if (typeof o.choice === "string") throw new TypeError("choice: give an array of strings, not one string");
    return { choice: { choices: [...o.choice] } };
  }
  return { jsonObject: true };
}

function defined<T extends object>(fields: T): Partial<T> | undefined {
  const out = Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined)) as Partial<T>;
  return Object.keys(out).length ? out : undefined;
}

function nonEmpty<T>(values: readonly T[] | undefined): T[] | undefined {
  return values === undefined || values.length === 0 ? undefined : [...values];
}

function logitBias(
  bias: Readonly<Record<number, number>> | ReadonlyMap<number, number> | undefined,
): { [key: number]: number } | undefined {
  if (bias === undefined) return undefined;
  const entries = bias instanceof Map ? [...bias.entries()] : Object.entries(bias);
  if (entries.length === 0) return undefined;
  return Object.fromEntries(entries.map(([k, v]) => [Number(k), Number(v)]));
}

/** A GenerateRequest from the options (a string is a plain-text prompt). */
export function generateRequest(options: GenerateOptions | string): GenerateRequest {
  const o: GenerateOptions = typeof options === "string" ? { prompt: options } : options;
  checkOptionNames(o, OPTION_NAMES, "generate");
  const inputs = (["prompt", "tokenIds", "messages", "fim"] as const).filter((k) => o[k] !== undefined);
  if (inputs.length !== 1) {
    throw new TypeError(
      "give exactly one of prompt, tokenIds, messages, fim" + (inputs.length ? ` (got ${inputs.join(", ")})` : ""),
    );
  }
  const fimMode = o.fim?.mode;
  if (fimMode !== undefined && fimMode !== "psm" && fimMode !== "spm") {
    throw new TypeError(`fim.mode ${JSON.stringify(fimMode)} is not one of "psm", "spm"`);
  }
  const sampling = defined({
    temperature: o.temperature,
    topK: o.topK,
    topP: o.topP,
    minP: o.minP,
    repetitionPenalty: o.repetitionPenalty,
    frequencyPenalty: o.frequencyPenalty,
    presencePenalty: o.presencePenalty,
    seed: o.seed === undefined ? undefined : BigInt(o.seed),
    repetitionPenaltyLastN: o.repetitionPenaltyLastN,
    typicalP: o.typicalP,
    topA: o.topA,
    xtcThreshold: o.xtcThreshold,
    xtcProbability: o.xtcProbability,
    dryMultiplier: o.dryMultiplier,
    dryBase: o.dryBase,
    dryAllowedLength: o.dryAllowedLength,
    dryPenaltyLastN: o.dryPenaltyLastN,
    drySequenceBreakers: nonEmpty(o.drySequenceBreakers),
    mirostat: o.mirostat,
    mirostatTau: o.mirostatTau,
    mirostatEta: o.mirostatEta,
    logitBias: logitBias(o.logitBias),
    bannedTokenIds: nonEmpty(o.bannedTokenIds),
    allowedTokenIds: nonEmpty(o.allowedTokenIds),
    badWords: nonEmpty(o.badWords),
  });
  const stopping = defined({
    maxNewTokens: o.maxNewTokens,
    minNewTokens: o.minNewTokens,
    stopSequences: o.stop === undefined ? undefined : typeof o.stop === "string" ? [o.stop] : [...o.stop],
    stopTokenIds: o.stopTokenIds === undefined ? undefined : [...o.stopTokenIds],
    ignoreEos: o.ignoreEos,
    includeStopSequence: o.includeStopSequence,
    timeLimitMs: o.timeLimitMs,
  });
  return GenerateRequest.fromPartial({
    requestId: o.requestId ?? "",
    text: o.prompt,
    tokenIds: o.tokenIds === undefined ? undefined : { ids: [...o.tokenIds] },
    messages: o.messages === undefined ? undefined : messagesProto(o.messages),
    fim:
      o.fim === undefined
        ? undefined
        : {
            prefix: o.fim.prefix ?? "",
            suffix: o.fim.suffix ?? "",
            mode: fimMode === "spm" ? FimMode.FIM_MODE_SPM : fimMode === "psm" ? FimMode.FIM_MODE_PSM : FimMode.FIM_MODE_UNSPECIFIED,
          },
    sessionId: o.sessionId ?? "",
    sampling,
    stopping,
    topLogprobs: o.topLogprobs ?? 0,
    promptLogprobs: o.promptLogprobs ?? 0,
    n: o.n ?? 0,
    bestOf: o.bestOf,
    priority: priorityValue(o.priority),
    addSpecialTokens: o.addSpecialTokens,
    skipSpecialTokens: o.skipSpecialTokens,
    cacheSalt: o.cacheSalt,
    truncatePromptTokens: o.truncatePromptTokens,
    chatTemplateKwargs: o.chatTemplateKwargs ? JSON.stringify(o.chatTemplateKwargs) : "",
    contextOverflow: contextOverflowValue(o.contextOverflow),
    constraint: constraintProto(o),
    tools: (o.tools ?? []).map(toolProto),
    toolChoice: o.toolChoice ?? "",
  });
}
