// Against a live genai-server at GENAI_TARGET (tests/clients/test_node_client.py
// starts one on a tiny fixture model whose vocabulary is plain words); skipped
// without it.
import { after, describe, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { CancelledError, GenAIClient, InvalidArgumentError, NotFoundError, UnauthenticatedError } from "../src";

const target = process.env.GENAI_TARGET;

describe("live server", { skip: target ? false : "GENAI_TARGET is not set" }, () => {
  const client = new GenAIClient(target ?? "", { timeoutMs: 60_000 });
  after(() => client.close());

  test("a stream's deltas concatenate to the final text, the same as generate", async () => {
    const request = { prompt: "the cat sat on the mat", maxNewTokens: 12, ignoreEos: true };
    const stream = client.stream(request);
    const texts: string[] = [];
    let tokens = 0;
    for await (const delta of stream) {
      texts.push(delta.text);
      tokens += delta.tokenIds.length;
    }
    const result = stream.result;
    assert.equal(texts.join(""), result.text);
    assert.ok(result.text.length > 0);
    assert.equal(tokens, 12);
    assert.equal(result.tokenIds.length, 12);
    assert.equal(result.finishReason, "MAX_TOKENS");
    assert.equal(result.usage.completionTokens, 12);
    const unary = await client.generate(request);
    assert.equal(unary.text, result.text);
    assert.deepEqual(unary.tokenIds, result.tokenIds);
  });

  test("a session rewinds and forks, each continuing from the kept history", async () => {
    const session = await client.session();
    const req = (prompt: string) => ({ prompt, maxNewTokens: 4, ignoreEos: true });
    const t1 = await session.generate(req("hello , who are you ?"));
    await session.generate(req("what is your name ?"));
    const fork = await session.fork({ turns: 1, metadata: { b: "1" } });
    const forked = await fork.info();
    assert.equal(forked.turns, 1);
    assert.equal(forked.historyTokens, t1.sessionTokens);
    assert.deepEqual(forked.metadata, { b: "1" });
    const rewound = await session.rewind({ turns: 1 });
    assert.equal(rewound.turns, 1);
    assert.equal(rewound.historyTokens, t1.sessionTokens);
    assert.equal((await session.rewind({ historyTokens: 2 })).historyTokens, 2);
    await assert.rejects(session.rewind({ turns: 5 }), InvalidArgumentError);
    await assert.rejects(session.rewind({}), TypeError);
    await fork.close();
    await session.close();
  });

  test("fields and enums round-trip through the server", async () => {
    const seed = 2n ** 62n + 12345n; // beyond Number.MAX_SAFE_INTEGER
    const result = await client.generate({
      prompt: "hello , who are you ?",
      requestId: "node-roundtrip",
      maxNewTokens: 5,
      ignoreEos: true,
      topLogprobs: 2,
      temperature: 0.8,
      seed,
      priority: "high",
      skipSpecialTokens: true,
    });
    assert.equal(result.requestId, "node-roundtrip");
    assert.equal(result.seed, seed);
    assert.equal(result.finishReason, "MAX_TOKENS");
    assert.equal(result.logprobs.length, 5);
    for (const lp of result.logprobs) assert.equal(lp.top.length, 2);
    assert.equal(result.usage.completionTokens, 5);
    const again = await client.generate({ prompt: "hello , who are you ?", maxNewTokens: 5, ignoreEos: true, temperature: 0.8, seed });
    assert.deepEqual(again.tokenIds, result.tokenIds); // the seed arrived exactly
    // Its own first token as the stop token (any model: not one fixture's tokens).
    const free = await client.generate({ tokenIds: [3, 6], maxNewTokens: 2, ignoreEos: true, temperature: 0.8, seed });
    const stopped = await client.generate({ tokenIds: [3, 6], maxNewTokens: 20, stopTokenIds: free.tokenIds.slice(0, 1), temperature: 0.8, seed });
    assert.equal(stopped.finishReason, "STOP_SEQUENCE");
    assert.equal(stopped.tokenIds.length, 1);
    const info = await client.modelInfo();
    assert.ok(info.contextLength >= 4096);
    assert.ok(["PAST_PRESENT", "SHARED_BUFFER", "STATIC_CACHE"].includes(info.runnerKind));
  });

  test("a two-turn session reuses turn 1's KV; sessions list, reset and close", async () => {
    const session = await client.session({ metadata: { user: "ada" } });
    const t1 = await session.generate({ prompt: "hello , who are you ?", maxNewTokens: 6, ignoreEos: true });
    const s2 = session.stream({ prompt: "what is your name ?", maxNewTokens: 6, ignoreEos: true });
    const t2 = await s2.collect();
    assert.equal(t1.sessionId, session.id);
    assert.ok(
      t2.usage.cachedTokens >= t1.usage.promptTokens + t1.usage.completionTokens,
      `turn 2 cachedTokens ${t2.usage.cachedTokens} < turn 1's ${t1.usage.promptTokens}+${t1.usage.completionTokens}`,
    );
    const info = await session.info();
    assert.equal(info.turns, 2);
    assert.equal(info.historyTokens, t2.sessionTokens);
    assert.deepEqual(info.metadata, { user: "ada" });
    assert.ok(info.createdAt instanceof Date);

    const others = [await client.createSession(), await client.createSession()];
    const page = await client.listSessionsPage({ pageSize: 1 });
    assert.equal(page.sessions.length, 1);
    assert.notEqual(page.nextPageToken, "");
    const all = (await client.listSessions({ pageSize: 1 })).map((s) => s.sessionId);
    for (const id of [session.id, ...others.map((s) => s.sessionId)]) assert.ok(all.includes(id));

    assert.equal((await session.reset()).historyTokens, 0);
    await session.close();
    await session.close(); // already closed: ignored
    await assert.rejects(client.getSession(session.id), NotFoundError);
    for (const s of others) await client.closeSession(s.sessionId);
  });

  test("aborting a stream's signal cancels it (CANCELLED)", async () => {
    const controller = new AbortController();
    const stream = client.stream({ prompt: "the cat", maxNewTokens: 4000, ignoreEos: true }, { signal: controller.signal });
    let deltas = 0;
    await assert.rejects(
      (async () => {
        for await (const _ of stream) {
          deltas += 1;
          if (deltas === 1) controller.abort();
        }
      })(),
      (error: unknown) => {
        assert.ok(error instanceof CancelledError, String(error));
        assert.equal(error.codeName, "CANCELLED");
        return true;
      },
    );
    assert.equal(stream.done, false);
    assert.ok(deltas < 4000);
    // an already aborted signal fails at once; a unary call is cancelled too
    assert.throws(() => client.stream("the cat", { signal: AbortSignal.abort() }), CancelledError);
    const unary = client.generate({ prompt: "the cat", maxNewTokens: 4000, ignoreEos: true }, { signal: AbortSignal.timeout(200) });
    await assert.rejects(unary, CancelledError);
  });

  test("a bad request is an InvalidArgumentError naming the field", async () => {
    await assert.rejects(client.generate({ prompt: "hello", temperature: -1 }), (error: unknown) => {
      assert.ok(error instanceof InvalidArgumentError, String(error));
      assert.deepEqual(error.fieldViolations.map((v) => v.field), ["sampling.temperature"]);
      assert.match(error.fieldViolations[0].description, /out of range/);
      return true;
    });
    // the same from a stream
    await assert.rejects(client.stream({ prompt: "hello", topP: 2 }).collect(), (error: unknown) => {
      assert.ok(error instanceof InvalidArgumentError, String(error));
      assert.deepEqual(error.fieldViolations.map((v) => v.field), ["sampling.top_p"]);
      return true;
    });
  });

  test("bidi: interleaved requests, one cancelled, one failed", async () => {
    const bidi = client.bidi();
    const good = bidi.start({ prompt: "the dog", maxNewTokens: 4, ignoreEos: true });
    const long = bidi.start({ prompt: "the cat", maxNewTokens: 4000, ignoreEos: true, requestId: "long" });
    const bad = bidi.start({ prompt: "hello", temperature: -1 });
    assert.equal(long, "long");
    const texts = new Map<string, string>();
    let cancelled = false;
    const results = new Map<string, unknown>();
    for await (const event of bidi) {
      if (event.delta) {
        texts.set(event.requestId, (texts.get(event.requestId) ?? "") + event.delta.text);
        if (event.requestId === long && !cancelled) {
          bidi.cancel(long);
          cancelled = true;
        }
      } else {
        results.set(event.requestId, event.result ?? event.error);
      }
    }
    await bidi.close();
    const goodResult = results.get(good) as { text: string; tokenIds: number[] };
    assert.equal(goodResult.text, texts.get(good) ?? "");
    assert.equal(goodResult.tokenIds.length, 4);
    assert.equal((results.get(long) as { finishReason: string }).finishReason, "CANCELLED");
    const error = results.get(bad);
    assert.ok(error instanceof InvalidArgumentError);
    assert.deepEqual(error.fieldViolations.map((v) => v.field), ["sampling.temperature"]);
  });

});

const secureTarget = process.env.GENAI_SECURE_TARGET;

describe("live server with mutual TLS and a bearer token", { skip: secureTarget ? false : "GENAI_SECURE_TARGET is not set" }, () => {
  test("the token and the client certificate get in; no token is UNAUTHENTICATED", async () => {
    const pki = process.env.GENAI_PKI_DIR ?? "";
    const tls = {
      rootCerts: readFileSync(join(pki, "ca.pem")),
      privateKey: readFileSync(join(pki, "client.key")),
      certChain: readFileSync(join(pki, "client.pem")),
    };
    const client = new GenAIClient(secureTarget ?? "", { ...tls, token: process.env.GENAI_TOKEN, timeoutMs: 30_000 });
    const anonymous = new GenAIClient(secureTarget ?? "", { ...tls, timeoutMs: 30_000 });
    const wrong = new GenAIClient(secureTarget ?? "", { ...tls, token: "not-the-token", timeoutMs: 30_000 });
    try {
      const result = await client.generate({ prompt: "hello", maxNewTokens: 3, ignoreEos: true });
      assert.equal(result.tokenIds.length, 3);
      const session = await client.session();
      assert.equal((await session.generate({ prompt: "the cat", maxNewTokens: 2, ignoreEos: true })).sessionId, session.id);
      await session.close();
      await assert.rejects(anonymous.generate("hello"), UnauthenticatedError);
      await assert.rejects(wrong.listSessions(), UnauthenticatedError);
    } finally {
      for (const c of [client, anonymous, wrong]) c.close();
    }
  });
});
