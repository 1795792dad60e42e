/**
 * The genai.v1 client for Node, over @grpc/grpc-js, mirroring the Python
 * client (genai_client/client.py):
 *
 *     const client = new GenAIClient("127.0.0.1:50051", { token });
 *     const stream = client.stream({ prompt: "Once upon a time", maxNewTokens: 32 });
 *     for await (const delta of stream) process.stdout.write(delta.text);
 *     console.log(stream.result.usage);
 *
 * Every failed call rejects with a GenAIError subclass named after its status
 * code (errors.ts). Every call that names a session also sends its id as
 * `x-session-id` metadata, for proxies that hash on it (docs/design.md,
 * "Public API names"); the bearer token goes as `authorization` metadata.
 */
import { randomUUID } from "node:crypto";
import * as grpc from "@grpc/grpc-js";
import { BidiRequest, type BidiResponse, GenerateServiceClient } from "./gen/genai/v1/generate";
import { ModelServiceClient } from "./gen/genai/v1/model";
import { SessionServiceClient } from "./gen/genai/v1/session";
import type { Token } from "./gen/genai/v1/model";
import { Code, type GenAIError, InternalError, NotFoundError, errorFor, errorFromStatus, fromServiceError } from "./errors";
import { checkOptionNames, contextOverflowValue, type GenerateOptions, generateRequest, type MessageLike, messagesProto } from "./request";
import {
  type BidiEvent,
  type Delta,
  type GenerationResult,
  type ModelInfo,
  type SessionInfo,
  type TokenLogprob,
  deltaFromProto,
  modelInfoFromProto,
  resultFromProto,
  sessionFromProto,
} from "./types";

export const DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024;
export const DEFAULT_KEEPALIVE_TIME_MS = 60_000;
const KEEPALIVE_TIMEOUT_MS = 20_000;

/** How to reach the server (the Python client's keyword arguments). */
export interface ClientOptions {
  /** Use TLS (the system roots unless `rootCerts` is given). */
  tls?: boolean;
  /** PEM roots; a private key and chain make it mutual TLS. Any of them implies `tls`. */
  rootCerts?: Buffer;
  privateKey?: Buffer;
  certChain?: Buffer;
  /** Bearer token sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** Default deadline of every call, in milliseconds (per call: `timeoutMs`). */
  timeoutMs?: number;
  /** Keepalive ping interval (0: none). */
  keepaliveTimeMs?: number;
  maxMessageBytes?: number;
  /** Extra grpc-js channel options; they win over the ones above. */
  channelOptions?: grpc.ChannelOptions;
}

/** Per-call options. */
export interface CallOptions {
  /** Aborting it cancels the call (it then rejects with CancelledError). */
  signal?: AbortSignal;
  /** Deadline in milliseconds (DeadlineExceededError past it). */
  timeoutMs?: number;
}

const CLIENT_OPTIONS = new Set([
  "tls", "rootCerts", "privateKey", "certChain", "token", "timeoutMs", "keepaliveTimeMs",
  "maxMessageBytes", "channelOptions",
] satisfies (keyof ClientOptions)[]);
const CALL_OPTIONS = new Set(["signal", "timeoutMs"] satisfies (keyof CallOptions)[]);

type UnaryMethod<Req, Res> = (
  request: Req,
  metadata: grpc.Metadata,
  options: Partial<grpc.CallOptions>,
  callback: (error: grpc.ServiceError | null, response: Res) => void,
) => grpc.ClientUnaryCall;

function abortedError(): GenAIError {
  return errorFor(Code.CANCELLED, "the call's signal was aborted");
}

/** Cancels `call` when `signal` aborts; returns the function that stops listening. */
function onAbort(signal: AbortSignal | undefined, call: { cancel(): void }): () => void {
  if (signal === undefined) return () => {};
  const cancel = () => call.cancel();
  signal.addEventListener("abort", cancel, { once: true });
  return () => signal.removeEventListener("abort", cancel);
}

const HIGH_WATER = 256;

/** Messages of a server stream, read one at a time with backpressure; a
 * failed call throws its typed error after the messages received before it. */
class Inbox<T> {
  private readonly items: T[] = [];
  private failure: unknown = undefined;
  private ended = false;
  private wake: (() => void) | undefined;

  constructor(private readonly stream: grpc.ClientReadableStream<T> | grpc.ClientDuplexStream<unknown, T>) {
    stream.on("data", (message: T) => {
      this.items.push(message);
      if (this.items.length >= HIGH_WATER) stream.pause();
      this.notify();
    });
    stream.on("error", (error: unknown) => {
      this.failure = error;
      this.notify();
    });
    stream.on("end", () => {
      this.ended = true;
      this.notify();
    });
  }

  private notify(): void {
    const wake = this.wake;
    this.wake = undefined;
    wake?.();
  }

  /** The next message; undefined once the call ended OK. */
  async next(): Promise<T | undefined> {
    for (;;) {
      if (this.items.length > 0) {
        const item = this.items.shift() as T;
        if (this.items.length === HIGH_WATER / 2) this.stream.resume();
        return item;
      }
      if (this.failure !== undefined) throw fromServiceError(this.failure);
      if (this.ended) return undefined;
      await new Promise<void>((resolve) => (this.wake = resolve));
    }
  }
}

/**
 * A streamed request: `for await` it for Delta objects. Once the iteration
 * ended, `result` holds the whole GenerationResult (its text is the deltas'
 * text joined); `collect()` consumes the rest and returns it. Leaving the
 * loop early (break, throw) or `cancel()` cancels the request.
 */
export class GenerationStream implements AsyncIterable<Delta> {
  private readonly inbox: Inbox<import("./gen/genai/v1/generate").GenerateStreamResponse>;
  private readonly texts: string[] = [];
  private promptLogprobs: TokenLogprob[] = [];
  private readonly others = new Map<number, string>(); // n > 1: completions 1..
  private final: GenerationResult | undefined;
  private iterating = false;

  /** @internal */
  constructor(
    private readonly call: grpc.ClientReadableStream<import("./gen/genai/v1/generate").GenerateStreamResponse>,
    private readonly release: () => void,
  ) {
    this.inbox = new Inbox(call);
  }

  /** The whole result; throws until the stream has finished. */
  get result(): GenerationResult {
    if (this.final === undefined) throw new Error("the stream has not finished: iterate it or await collect()");
    return this.final;
  }

  /** Whether the final message arrived. */
  get done(): boolean {
    return this.final !== undefined;
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<Delta, void, undefined> {
    if (this.iterating) throw new Error("a GenerationStream is iterated once");
    this.iterating = true;
    try {
      for (;;) {
        const message = await this.inbox.next();
        if (message === undefined) break;
        if (message.delta !== undefined) {
          const index = message.delta.index;
          if (index === 0) this.texts.push(message.delta.text);
          else this.others.set(index, (this.others.get(index) ?? "") + message.delta.text);
          if (message.delta.promptLogprobs.length) this.promptLogprobs = message.delta.promptLogprobs;
          yield deltaFromProto(message.delta);
        } else if (message.final !== undefined) {
          const text = this.texts.join("");
          this.final = resultFromProto(message.final, text, this.promptLogprobs, new Map([...this.others, [0, text]]));
        }
      }
      if (this.final === undefined) throw new InternalError(Code.INTERNAL, "the stream ended without a final message");
    } finally {
      if (this.final === undefined) this.call.cancel();
      this.release();
    }
  }

  /** Consume the remaining deltas and return the whole result. */
  async collect(): Promise<GenerationResult> {
    if (this.final === undefined) for await (const _ of this);
    return this.result;
  }

  /** Cancel the request; the iteration then throws CancelledError. */
  cancel(): void {
    this.call.cancel();
  }
}

/**
 * Several requests multiplexed on one GenerateBidi call. `start()` sends a
 * request and returns its id; `cancel(id)` cancels one (it ends with
 * finishReason "CANCELLED"). `for await` yields the events of all requests,
 * interleaved, until every started request has ended; start more and iterate
 * again as needed. A request's failure is an event with `error` set; a
 * failure of the whole call throws. `close()` ends the call.
 */
export class BidiStream implements AsyncIterable<BidiEvent> {
  private readonly inbox: Inbox<BidiResponse>;
  private readonly texts = new Map<string, string[]>(); // running request id -> delta texts
  private closed = false;

  /** @internal */
  constructor(
    private readonly call: grpc.ClientDuplexStream<BidiRequest, BidiResponse>,
    private readonly release: () => void,
  ) {
    this.inbox = new Inbox(call);
  }

  /** Ids of the started requests that have not ended yet. */
  get pending(): string[] {
    return [...this.texts.keys()];
  }

  /** Start a request (options as GenAIClient.generate); returns its id
   * (`requestId` if given, else a fresh random one). */
  start(request: GenerateOptions | string): string {
    if (this.closed) throw new Error("the bidi stream is closed");
    const options = typeof request === "string" ? { prompt: request } : request;
    const requestId = options.requestId || randomUUID().replace(/-/g, "");
    if (this.texts.has(requestId)) throw new TypeError(`requestId ${requestId} is already running on this stream`);
    const start = generateRequest({ ...options, requestId });
    this.texts.set(requestId, []);
    this.call.write(BidiRequest.fromPartial({ start }));
    return requestId;
  }

  /** Cancel a started request (ignored by the server once it ended). */
  cancel(requestId: string): void {
    if (!this.closed) this.call.write(BidiRequest.fromPartial({ cancel: { requestId } }));
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<BidiEvent, void, undefined> {
    while (this.texts.size > 0) {
      const message = await this.inbox.next();
      if (message === undefined) {
        throw new InternalError(Code.INTERNAL, `the stream ended with requests still running: ${this.pending}`);
      }
      const texts = this.texts.get(message.requestId);
      if (texts === undefined) continue; // not ours (or already ended)
      const id = message.requestId;
      if (message.delta !== undefined) {
        texts.push(message.delta.text);
        yield { requestId: id, delta: deltaFromProto(message.delta) };
      } else if (message.final !== undefined) {
        this.texts.delete(id);
        yield { requestId: id, result: resultFromProto(message.final, texts.join("")) };
      } else if (message.error !== undefined) {
        this.texts.delete(id);
        yield { requestId: id, error: errorFromStatus(message.error) };
      }
    }
  }

  /** Consume events until every started request has ended; each request's
   * result, or its error, by request id. */
  async results(): Promise<Map<string, GenerationResult | GenAIError>> {
    const out = new Map<string, GenerationResult | GenAIError>();
    for await (const event of this) {
      if (event.result !== undefined) out.set(event.requestId, event.result);
      else if (event.error !== undefined) out.set(event.requestId, event.error);
    }
    return out;
  }

  /** Half-close the call and wait for it to end; requests still running are
   * cancelled with the call. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.call.end();
    try {
      if (this.texts.size > 0) {
        this.texts.clear();
        this.call.cancel();
        return;
      }
      while ((await this.inbox.next()) !== undefined); // the server ends the call after half-close
    } catch (error) {
      if ((error as GenAIError).code !== Code.CANCELLED) throw error;
    } finally {
      this.release();
    }
  }
}

/**
 * A server-side session; each generate/stream is a turn of it (made by
 * GenAIClient.session). `close()` closes it on the server (an expired one is
 * ignored).
 */
export class Session {
  /** @internal */
  constructor(
    private readonly client: GenAIClient,
    private last: SessionInfo,
  ) {}

  /** The session id. */
  get id(): string {
    return this.last.sessionId;
  }

  /** The state the server last reported. */
  get lastInfo(): SessionInfo {
    return this.last;
  }

  private turn(request: GenerateOptions | string): GenerateOptions {
    const options = typeof request === "string" ? { prompt: request } : request;
    return { ...options, sessionId: this.id };
  }

  /** Run one turn to completion (options as GenAIClient.generate). */
  generate(request: GenerateOptions | string, options?: CallOptions): Promise<GenerationResult> {
    return this.client.generate(this.turn(request), options);
  }

  /** Run one turn, streaming (see GenAIClient.stream). */
  stream(request: GenerateOptions | string, options?: CallOptions): GenerationStream {
    return this.client.stream(this.turn(request), options);
  }

  /** The session's current state. */
  async info(options?: CallOptions): Promise<SessionInfo> {
    return (this.last = await this.client.getSession(this.id, options));
  }

  /** Clear the history (the id stays valid). */
  async reset(options?: CallOptions): Promise<SessionInfo> {
    return (this.last = await this.client.resetSession(this.id, options));
  }

  /** Step back to the first `turns` turns or `historyTokens` tokens (give one);
   * the KV of what is kept stays on the server. */
  async rewind(target: { turns?: number; historyTokens?: number }, options?: CallOptions): Promise<SessionInfo> {
    return (this.last = await this.client.rewindSession(this.id, target, options));
  }

  /** A new session with this one's history (or its first `turns` turns),
   * its KV shared on the server. */
  async fork(
    request: { turns?: number; idleTtlSeconds?: number; metadata?: Record<string, string> } = {},
    options?: CallOptions,
  ): Promise<Session> {
    return new Session(this.client, await this.client.forkSession(this.id, request, options));
  }

  /** Close the session on the server; an expired one is ignored. */
  async close(options?: CallOptions): Promise<void> {
    try {
      await this.client.closeSession(this.id, options);
    } catch (error) {
      if (!(error instanceof NotFoundError)) throw error;
    }
  }
}

/** Options of GenAIClient.session. */
export interface SessionOptions extends CallOptions {
  /** Attach to this existing session instead of creating one. */
  sessionId?: string;
  /** Idle time-to-live of a new session (unset: the server's default). */
  idleTtlSeconds?: number;
  /** Metadata of a new session. */
  metadata?: Record<string, string>;
  /** What a new session's turns do at the context window ("error" | "slide"). */
  contextOverflow?: "error" | "slide";
}

/** A client of one genai-server: one channel shared by the three services. */
export class GenAIClient {
  private readonly generateStub: GenerateServiceClient;
  private readonly sessionStub: SessionServiceClient;
  private readonly modelStub: ModelServiceClient;
  private readonly token: string | undefined;
  private readonly timeoutMs: number | undefined;

  constructor(target: string, options: ClientOptions = {}) {
    checkOptionNames(options, CLIENT_OPTIONS, "client");
    const maxBytes = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
    const keepalive = options.keepaliveTimeMs ?? DEFAULT_KEEPALIVE_TIME_MS;
    const channelOptions: grpc.ChannelOptions = {
      "grpc.max_send_message_length": maxBytes,
      "grpc.max_receive_message_length": maxBytes,
      ...(keepalive ? { "grpc.keepalive_time_ms": keepalive, "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS } : {}),
      ...options.channelOptions,
    };
    const { tls, rootCerts, privateKey, certChain } = options;
    const credentials =
      tls || rootCerts || privateKey || certChain
        ? grpc.credentials.createSsl(rootCerts ?? null, privateKey ?? null, certChain ?? null)
        : grpc.credentials.createInsecure();
    this.generateStub = new GenerateServiceClient(target, credentials, channelOptions);
    const shared = { channelOverride: this.generateStub.getChannel() };
    this.sessionStub = new SessionServiceClient(target, credentials, shared);
    this.modelStub = new ModelServiceClient(target, credentials, shared);
    this.token = options.token;
    this.timeoutMs = options.timeoutMs;
  }

  // --- plumbing --------------------------------------------------------

  private metadata(sessionId?: string): grpc.Metadata {
    const md = new grpc.Metadata();
    if (this.token) md.set("authorization", `Bearer ${this.token}`);
    if (sessionId) md.set("x-session-id", sessionId);
    return md;
  }

  private callOptions(options: CallOptions | undefined): Partial<grpc.CallOptions> {
    checkOptionNames(options ?? {}, CALL_OPTIONS, "call");
    const timeoutMs = options?.timeoutMs ?? this.timeoutMs;
    return timeoutMs === undefined ? {} : { deadline: new Date(Date.now() + timeoutMs) };
  }

  private unary<Req, Res>(
    method: UnaryMethod<Req, Res>,
    stub: grpc.Client,
    request: Req,
    sessionId: string | undefined,
    options: CallOptions | undefined,
  ): Promise<Res> {
    const callOptions = this.callOptions(options);
    const signal = options?.signal;
    if (signal?.aborted) return Promise.reject(abortedError());
    return new Promise<Res>((resolve, reject) => {
      let release = () => {};
      const call = method.call(stub, request, this.metadata(sessionId), callOptions, (error, response) => {
        release();
        if (error) reject(fromServiceError(error));
        else resolve(response);
      });
      release = onAbort(signal, call);
    });
  }

  // --- generation ------------------------------------------------------

  /** Run one request to completion (a string is a plain-text prompt). */
  async generate(request: GenerateOptions | string, options?: CallOptions): Promise<GenerationResult> {
    const req = generateRequest(request);
    const response = await this.unary(
      this.generateStub.generate as UnaryMethod<typeof req, import("./gen/genai/v1/generate").GenerateResponse>,
      this.generateStub,
      req,
      req.sessionId,
      options,
    );
    return resultFromProto(response);
  }

  /** Stream one request: `for await` the returned stream for its deltas;
   * its `result` holds the whole result once the loop ended. */
  stream(request: GenerateOptions | string, options?: CallOptions): GenerationStream {
    const req = generateRequest(request);
    const callOptions = this.callOptions(options);
    if (options?.signal?.aborted) throw abortedError();
    const call = this.generateStub.generateStream(req, this.metadata(req.sessionId), callOptions);
    return new GenerationStream(call, onAbort(options?.signal, call));
  }

  /** Open a GenerateBidi call; `sessionId` only sets the call's `x-session-id`
   * metadata (each started request names its own session). */
  bidi(options?: CallOptions & { sessionId?: string }): BidiStream {
    const { sessionId, ...rest } = options ?? {};
    const callOptions = this.callOptions(rest);
    if (rest.signal?.aborted) throw abortedError();
    const call = this.generateStub.generateBidi(this.metadata(sessionId), callOptions);
    return new BidiStream(call, onAbort(rest.signal, call));
  }

  // --- sessions --------------------------------------------------------

  /** Create a session (or attach to `sessionId`); its generate/stream are turns. */
  async session(options: SessionOptions = {}): Promise<Session> {
    const { sessionId, idleTtlSeconds, metadata, contextOverflow, ...call } = options;
    const info = sessionId
      ? await this.getSession(sessionId, call)
      : await this.createSession({ idleTtlSeconds, metadata, contextOverflow }, call);
    return new Session(this, info);
  }

  /** Create an empty session (idleTtlSeconds unset: the server's default). */
  async createSession(
    request: {
      idleTtlSeconds?: number;
      metadata?: Record<string, string>;
      contextOverflow?: "error" | "slide";
    } = {},
    options?: CallOptions,
  ): Promise<SessionInfo> {
    checkOptionNames(request, new Set(["idleTtlSeconds", "metadata", "contextOverflow"]), "createSession");
    const req = {
      idleTtlSeconds: request.idleTtlSeconds,
      metadata: { ...request.metadata },
      contextOverflow: contextOverflowValue(request.contextOverflow),
    };
    const stub = this.sessionStub;
    const response = await this.unary(stub.createSession as UnaryMethod<typeof req, SessionResponse>, stub, req, undefined, options);
    return sessionFromProto(response.session);
  }

  /** Describe a session (NotFoundError if unknown or expired). */
  async getSession(sessionId: string, options?: CallOptions): Promise<SessionInfo> {
    const stub = this.sessionStub;
    const method = stub.getSession as UnaryMethod<{ sessionId: string }, SessionResponse>;
    return sessionFromProto((await this.unary(method, stub, { sessionId }, sessionId, options)).session);
  }

  /** Clear a session's history, keeping its id. */
  async resetSession(sessionId: string, options?: CallOptions): Promise<SessionInfo> {
    const stub = this.sessionStub;
    const method = stub.resetSession as UnaryMethod<{ sessionId: string }, SessionResponse>;
    return sessionFromProto((await this.unary(method, stub, { sessionId }, sessionId, options)).session);
  }

  /** Cut a session's history to its first `turns` turns or `historyTokens`
   * tokens (give one); its KV of the rest stays. */
  async rewindSession(
    sessionId: string,
    target: { turns?: number; historyTokens?: number },
    options?: CallOptions,
  ): Promise<SessionInfo> {
    checkOptionNames(target, new Set(["turns", "historyTokens"]), "rewindSession");
    if ((target.turns === undefined) === (target.historyTokens === undefined)) {
      throw new TypeError("rewindSession: give one of turns and historyTokens");
    }
    const req = { sessionId, turns: target.turns, historyTokens: target.historyTokens };
    const stub = this.sessionStub;
    const method = stub.rewindSession as UnaryMethod<typeof req, SessionResponse>;
    return sessionFromProto((await this.unary(method, stub, req, sessionId, options)).session);
  }

  /** A new session whose history is `sessionId`'s (or its first `turns` turns),
   * sharing its KV on the server. */
  async forkSession(
    sessionId: string,
    request: { turns?: number; idleTtlSeconds?: number; metadata?: Record<string, string> } = {},
    options?: CallOptions,
  ): Promise<SessionInfo> {
    checkOptionNames(request, new Set(["turns", "idleTtlSeconds", "metadata"]), "forkSession");
    const req = {
      sessionId,
      turns: request.turns,
      idleTtlSeconds: request.idleTtlSeconds,
      metadata: { ...request.metadata },
    };
    const stub = this.sessionStub;
    const method = stub.forkSession as UnaryMethod<typeof req, SessionResponse>;
    return sessionFromProto((await this.unary(method, stub, req, sessionId, options)).session);
  }

  /** Close a session and free what it holds. */
  async closeSession(sessionId: string, options?: CallOptions): Promise<void> {
    const stub = this.sessionStub;
    await this.unary(stub.closeSession as UnaryMethod<{ sessionId: string }, object>, stub, { sessionId }, sessionId, options);
  }

  /** One page of the caller's open sessions, oldest first. */
  async listSessionsPage(
    page: { pageSize?: number; pageToken?: string } = {},
    options?: CallOptions,
  ): Promise<{ sessions: SessionInfo[]; nextPageToken: string }> {
    const req = { pageSize: page.pageSize ?? 0, pageToken: page.pageToken ?? "" };
    const stub = this.sessionStub;
    type ListResponse = import("./gen/genai/v1/session").ListSessionsResponse;
    const response = await this.unary(stub.listSessions as UnaryMethod<typeof req, ListResponse>, stub, req, undefined, options);
    return { sessions: response.sessions.map(sessionFromProto), nextPageToken: response.nextPageToken };
  }

  /** The caller's open sessions, every page, fetched `pageSize` at a time
   * (0: the server's default); `timeoutMs` bounds each page's call. */
  async listSessions(page: { pageSize?: number } = {}, options?: CallOptions): Promise<SessionInfo[]> {
    const sessions: SessionInfo[] = [];
    let pageToken = "";
    do {
      const got = await this.listSessionsPage({ pageSize: page.pageSize, pageToken }, options);
      sessions.push(...got.sessions);
      pageToken = got.nextPageToken;
    } while (pageToken);
    return sessions;
  }

  // --- model -----------------------------------------------------------

  /** Describe the served model. */
  async modelInfo(options?: CallOptions): Promise<ModelInfo> {
    const stub = this.modelStub;
    type Response = import("./gen/genai/v1/model").GetModelInfoResponse;
    const response = await this.unary(stub.getModelInfo as UnaryMethod<object, Response>, stub, {}, undefined, options);
    return modelInfoFromProto(response.modelInfo);
  }

  /** Encode text (or chat messages) as the server would; each token with its
   * vocabulary string and character span. */
  async tokenize(
    input: string | { messages: readonly MessageLike[] },
    request: { addSpecialTokens?: boolean } = {},
    options?: CallOptions,
  ): Promise<Token[]> {
    const req = {
      ...(typeof input === "string" ? { text: input } : { messages: messagesProto(input.messages) }),
      addSpecialTokens: request.addSpecialTokens,
      returnTokens: true,
    };
    const stub = this.modelStub;
    type Response = import("./gen/genai/v1/model").TokenizeResponse;
    return (await this.unary(stub.tokenize as UnaryMethod<typeof req, Response>, stub, req, undefined, options)).tokens;
  }

  /** Decode token ids to text (special tokens skipped unless asked). */
  async detokenize(
    tokenIds: readonly number[],
    request: { skipSpecialTokens?: boolean } = {},
    options?: CallOptions,
  ): Promise<string> {
    const req = { tokenIds: [...tokenIds], skipSpecialTokens: request.skipSpecialTokens };
    const stub = this.modelStub;
    type Response = import("./gen/genai/v1/model").DetokenizeResponse;
    return (await this.unary(stub.detokenize as UnaryMethod<typeof req, Response>, stub, req, undefined, options)).text;
  }

  // --- lifetime --------------------------------------------------------

  /** Close the channel; calls still running are cancelled. */
  close(): void {
    this.generateStub.close();
  }
}

type SessionResponse = { session?: import("./gen/genai/v1/session").Session | undefined };
