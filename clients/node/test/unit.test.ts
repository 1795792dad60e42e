// No genai-server: field names and enums round-trip exactly, option names are
// checked, and the metadata every call carries, against an in-process grpc-js
// server that records what it receives.
import { test } from "node:test";
import assert from "node:assert/strict";
import * as grpc from "@grpc/grpc-js";
import { GenAIClient, type GenerateOptions, InvalidArgumentError, generateRequest } from "../src";
import { Priority, priorityFromJSON } from "../src/gen/genai/v1/common";
import { GenerateRequest, GenerateResponse, GenerateServiceService } from "../src/gen/genai/v1/generate";
import { GetSessionResponse, SessionServiceService } from "../src/gen/genai/v1/session";
import { Status } from "../src/gen/google/rpc/status";
import { BinaryWriter } from "@bufbuild/protobuf/wire";

const EVERY_FIELD: GenerateOptions = {
  requestId: "r-1",
  messages: [{ role: "user", content: "hi", name: "ada", toolCallId: "call_1", toolCalls: [{ id: "c", name: "f", argumentsJson: "{}" }] }],
  sessionId: "s-1",
  temperature: 0.5,
  topK: 3,
  topP: 0.9,
  minP: 0.1,
  repetitionPenalty: 1.1,
  frequencyPenalty: 0.2,
  presencePenalty: 0.3,
  seed: 2n ** 63n + 5n,
  repetitionPenaltyLastN: 64,
  typicalP: 0.9,
  topA: 0.2,
  xtcThreshold: 0.1,
  xtcProbability: 0.5,
  dryMultiplier: 0.8,
  dryBase: 1.75,
  dryAllowedLength: 2,
  dryPenaltyLastN: 128,
  drySequenceBreakers: ["\n", ":"],
  mirostat: 2,
  mirostatTau: 5,
  mirostatEta: 0.1,
  logitBias: { 42: -100, 7: 2.5 },
  bannedTokenIds: [1],
  allowedTokenIds: [2, 3],
  badWords: ["no"],
  maxNewTokens: 7,
  minNewTokens: 1,
  stop: ["."],
  stopTokenIds: [2, 9],
  ignoreEos: true,
  includeStopSequence: true,
  timeLimitMs: 500,
  topLogprobs: 2,
  priority: "high",
  addSpecialTokens: false,
  skipSpecialTokens: false,
  cacheSalt: "salt",
  choice: ["yes", "no"],
  tools: [{ name: "f", description: "d", parameters: { type: "object" } }],
  toolChoice: "auto",
};

test("every field survives encode/decode and the JSON form, under both spellings", () => {
  const request = generateRequest(EVERY_FIELD);
  assert.equal(request.sampling?.seed, 2n ** 63n + 5n); // 64-bit exact
  assert.equal(request.priority, Priority.PRIORITY_HIGH);
  const decoded = GenerateRequest.decode(GenerateRequest.encode(request).finish());
  // floats travel as float32
  assert.deepEqual({ ...decoded, sampling: undefined }, { ...request, sampling: undefined });
  assert.equal(decoded.sampling?.topK, 3);
  assert.equal(decoded.sampling?.mirostat, 2);
  assert.equal(decoded.sampling?.dryAllowedLength, 2);
  assert.deepEqual(decoded.sampling?.logitBias, { 42: -100, 7: 2.5 });
  assert.deepEqual(decoded.sampling?.drySequenceBreakers, ["\n", ":"]);
  assert.deepEqual(decoded.sampling?.allowedTokenIds, [2, 3]);
  assert.deepEqual(decoded.sampling?.badWords, ["no"]);
  const fim = generateRequest({ fim: { prefix: "a", suffix: "b", mode: "spm" } });
  assert.deepEqual(GenerateRequest.decode(GenerateRequest.encode(fim).finish()).fim, { prefix: "a", suffix: "b", mode: 2 });
  assert.throws(() => generateRequest({ prompt: "x", fim: { prefix: "a" } }), /exactly one/);
  assert.equal(decoded.stopping?.maxNewTokens, 7);
  assert.equal(decoded.stopping?.timeLimitMs, 500);
  assert.deepEqual(decoded.constraint?.choice, { choices: ["yes", "no"] });
  const json = GenerateRequest.toJSON(decoded) as Record<string, unknown>;
  assert.deepEqual(GenerateRequest.fromJSON(json), decoded);
  // proto field names (what proto-loader without keepCase drops) read the same
  const snake = { request_id: "r-1", session_id: "s-1", top_logprobs: 2, priority: "PRIORITY_LOW", stopping: { max_new_tokens: 9, stop_token_ids: [4] }, cache_salt: "x" };
  const camel = { requestId: "r-1", sessionId: "s-1", topLogprobs: 2, priority: "PRIORITY_LOW", stopping: { maxNewTokens: 9, stopTokenIds: [4] }, cacheSalt: "x" };
  assert.deepEqual(GenerateRequest.fromJSON(snake), GenerateRequest.fromJSON(camel));
  assert.equal(GenerateRequest.fromJSON(snake).stopping?.maxNewTokens, 9);
  // unset proto3 `optional` fields stay unset (presence survives)
  const bare = GenerateRequest.decode(GenerateRequest.encode(generateRequest({ prompt: "x", temperature: 0 })).finish());
  assert.equal(bare.sampling?.temperature, 0);
  assert.equal(bare.sampling?.topP, undefined);
  assert.equal(bare.stopping, undefined);
});

test("an unknown enum name or option name is an error, never 0 or dropped", () => {
  assert.throws(() => priorityFromJSON("PRIORITY_URGENT"), /Unrecognized enum value PRIORITY_URGENT/);
  assert.throws(() => GenerateRequest.fromJSON({ priority: "PRIORITY_URGENT" }), /Unrecognized enum/);
  // @ts-expect-error: not a priority
  assert.throws(() => generateRequest({ prompt: "x", priority: "urgent" }), /priority "urgent" is not one of/);
  // @ts-expect-error: snake_case is not an option name
  assert.throws(() => generateRequest({ prompt: "x", max_new_tokens: 5 }), /max_new_tokens \(did you mean maxNewTokens\?\)/);
  assert.throws(() => generateRequest({ prompt: "x", tokenIds: [1] }), /exactly one of prompt, tokenIds, messages/);
  assert.throws(() => generateRequest({ prompt: "x", regex: "a", grammar: "b" }), /at most one constraint/);
  assert.equal(generateRequest({ prompt: "x", priority: "low" }).priority, Priority.PRIORITY_LOW);
  // @ts-expect-error: snake_case client option
  assert.throws(() => new GenAIClient("127.0.0.1:1", { timeout_ms: 5 }), /timeout_ms \(did you mean timeoutMs\?\)/);
});

function badRequestDetails(field: string, description: string): Buffer {
  const violation = new BinaryWriter().uint32(10).string(field).uint32(18).string(description).finish();
  const badRequest = new BinaryWriter().uint32(10).bytes(violation).finish();
  const st = Status.fromPartial({
    code: grpc.status.INVALID_ARGUMENT,
    message: `${field}: ${description}`,
    details: [{ typeUrl: "type.googleapis.com/google.rpc.BadRequest", value: Buffer.from(badRequest) }],
  });
  return Buffer.from(Status.encode(st).finish());
}

test("calls carry the token and x-session-id; error details become fieldViolations", async (t) => {
  const seen: Record<string, grpc.Metadata> = {};
  const server = new grpc.Server();
  server.addService(GenerateServiceService, {
    generate: (call: grpc.ServerUnaryCall<GenerateRequest, GenerateResponse>, done: grpc.sendUnaryData<GenerateResponse>) => {
      seen[call.request.text ?? ""] = call.metadata;
      if (call.request.text === "bad") {
        const trailer = new grpc.Metadata();
        trailer.set("grpc-status-details-bin", badRequestDetails("sampling.top_p", "must be in (0, 1]"));
        done({ code: grpc.status.INVALID_ARGUMENT, details: "sampling.top_p: must be in (0, 1]", metadata: trailer } as grpc.ServiceError);
        return;
      }
      done(null, GenerateResponse.fromPartial({ text: "ok", finishReason: 1, seed: 2n ** 62n, sessionId: call.request.sessionId }));
    },
    generateStream: () => {},
    generateBidi: () => {},
  });
  server.addService(SessionServiceService, {
    getSession: (call: grpc.ServerUnaryCall<unknown, GetSessionResponse>, done: grpc.sendUnaryData<GetSessionResponse>) => {
      seen.getSession = call.metadata;
      done(null, GetSessionResponse.fromPartial({ session: { sessionId: "s-9", turns: 2 } }));
    },
    createSession: () => {}, resetSession: () => {}, closeSession: () => {}, listSessions: () => {},
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
  );
  t.after(() => server.forceShutdown());
  const client = new GenAIClient(`127.0.0.1:${port}`, { token: "sekrit" });
  t.after(() => client.close());

  const result = await client.generate({ prompt: "turn", sessionId: "s-1" });
  assert.equal(result.finishReason, "MAX_TOKENS");
  assert.equal(result.seed, 2n ** 62n);
  assert.equal(result.sessionId, "s-1");
  assert.deepEqual(seen.turn.get("authorization"), ["Bearer sekrit"]);
  assert.deepEqual(seen.turn.get("x-session-id"), ["s-1"]);
  await client.generate("stateless");
  assert.deepEqual(seen.stateless.get("x-session-id"), []);
  const session = await client.session({ sessionId: "s-9" });
  assert.equal(session.lastInfo.turns, 2);
  assert.deepEqual(seen.getSession.get("x-session-id"), ["s-9"]);

  await assert.rejects(client.generate("bad"), (error: unknown) => {
    assert.ok(error instanceof InvalidArgumentError);
    assert.equal(error.codeName, "INVALID_ARGUMENT");
    assert.deepEqual(error.fieldViolations, [{ field: "sampling.top_p", description: "must be in (0, 1]" }]);
    return true;
  });
});
