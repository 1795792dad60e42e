/** genai-grpc's Node/TypeScript client (see README.md). */
export { GenAIClient, GenerationStream, BidiStream, Session } from "./client";
export type { ClientOptions, CallOptions, SessionOptions } from "./client";
export * from "./errors";
export type { GenerateOptions, MessageLike, ToolLike, ToolCallLike } from "./request";
export { generateRequest } from "./request";
export type * from "./types";
/** The generated message types and service clients, for what the wrapper does not cover. */
export * as proto from "./gen/genai/v1/generate";
