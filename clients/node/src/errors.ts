/**
 * Typed errors for failed calls, one class per gRPC status code the server
 * uses (docs/design.md, "Status codes"), as in the Python client's
 * genai_client/errors.py. Every error carries the status `code` (a number,
 * grpc-js `status`), its `codeName`, the server's `details` message and the
 * `fieldViolations` of the google.rpc.BadRequest the server sends in the
 * `grpc-status-details-bin` trailer (or in a GenerateBidi `error` event).
 */
import { Metadata, status as Code, type ServiceError } from "@grpc/grpc-js";
import { BinaryReader } from "@bufbuild/protobuf/wire";
import { Status } from "./gen/google/rpc/status";

export { Code };

/** One bad field of a request: its path (e.g. `sampling.temperature`; empty
 * when the server named none) and what is wrong with it. */
export interface FieldViolation {
  field: string;
  description: string;
}

const BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest";

/** A call failed with a status other than OK. Codes without a class of their
 * own (UNIMPLEMENTED, UNKNOWN, ...) are raised as this base class. */
export class GenAIError extends Error {
  readonly code: Code;
  readonly details: string;
  readonly fieldViolations: readonly FieldViolation[];
  readonly metadata: Metadata | undefined;

  constructor(
    code: Code,
    details: string,
    fieldViolations: readonly FieldViolation[] = [],
    metadata?: Metadata,
  ) {
    const name = Code[code] ?? String(code);
    super(details ? `${name}: ${details}` : name);
    this.name = new.target.name;
    this.code = code;
    this.details = details;
    this.fieldViolations = fieldViolations;
    this.metadata = metadata;
  }

  /** The status code's name, e.g. "INVALID_ARGUMENT". */
  get codeName(): string {
    return Code[this.code] ?? String(this.code);
  }
}

/** A parameter is out of range, the input is empty, or the prompt is longer
 * than the context window; `fieldViolations` name the fields. */
export class InvalidArgumentError extends GenAIError {}
/** The session id is unknown, expired or malformed. */
export class NotFoundError extends GenAIError {}
/** The session is already running a turn. */
export class FailedPreconditionError extends GenAIError {}
/** The queue is full, or the session limit or memory budget is reached. */
export class ResourceExhaustedError extends GenAIError {}
/** The server is unreachable, or its engine is starting, restarting or
 * draining; retrying later may succeed. */
export class UnavailableError extends GenAIError {}
/** The call's deadline (`timeoutMs`) passed before it completed. */
export class DeadlineExceededError extends GenAIError {}
/** The call was cancelled (an aborted `signal`, or `cancel()`). */
export class CancelledError extends GenAIError {}
/** The bearer token is missing or invalid. */
export class UnauthenticatedError extends GenAIError {}
/** The session belongs to another principal. */
export class PermissionDeniedError extends GenAIError {}
/** The server failed unexpectedly (it logs the request id and traceback). */
export class InternalError extends GenAIError {}

type ErrorClass = new (
  code: Code,
  details: string,
  fieldViolations?: readonly FieldViolation[],
  metadata?: Metadata,
) => GenAIError;

const BY_CODE = new Map<Code, ErrorClass>([
  [Code.INVALID_ARGUMENT, InvalidArgumentError],
  [Code.NOT_FOUND, NotFoundError],
  [Code.FAILED_PRECONDITION, FailedPreconditionError],
  [Code.RESOURCE_EXHAUSTED, ResourceExhaustedError],
  [Code.UNAVAILABLE, UnavailableError],
  [Code.DEADLINE_EXCEEDED, DeadlineExceededError],
  [Code.CANCELLED, CancelledError],
  [Code.UNAUTHENTICATED, UnauthenticatedError],
  [Code.PERMISSION_DENIED, PermissionDeniedError],
  [Code.INTERNAL, InternalError],
]);

/** The error for a status `code` with the server's `details`. */
export function errorFor(
  code: Code,
  details: string,
  fieldViolations: readonly FieldViolation[] = [],
  metadata?: Metadata,
): GenAIError {
  const cls = BY_CODE.get(code) ?? GenAIError;
  return new cls(code in Code ? code : Code.UNKNOWN, details, fieldViolations, metadata);
}

/** google.rpc.BadRequest { repeated FieldViolation field_violations = 1; }
 * with FieldViolation { string field = 1; string description = 2; ... }:
 * two fields are all the client reads, so they are decoded here rather than
 * generating googleapis' error_details.proto (not part of protos/). */
function decodeBadRequest(bytes: Uint8Array): FieldViolation[] {
  const violations: FieldViolation[] = [];
  const reader = new BinaryReader(bytes);
  while (reader.pos < reader.len) {
    const [number, wireType] = reader.tag();
    if (number !== 1) {
      reader.skip(wireType);
      continue;
    }
    const inner = new BinaryReader(reader.bytes());
    const violation: FieldViolation = { field: "", description: "" };
    while (inner.pos < inner.len) {
      const [n, w] = inner.tag();
      if (n === 1) violation.field = inner.string();
      else if (n === 2) violation.description = inner.string();
      else inner.skip(w);
    }
    violations.push(violation);
  }
  return violations;
}

/** The error for a google.rpc.Status (a GenerateBidi `error` event, or a
 * failed call's details trailer). */
export function errorFromStatus(st: Status, metadata?: Metadata): GenAIError {
  const violations = st.details
    .filter((d) => d.typeUrl === BAD_REQUEST_TYPE)
    .flatMap((d) => decodeBadRequest(d.value));
  return errorFor(st.code as Code, st.message, violations, metadata);
}

/** Translate a failed grpc-js call into its typed error. A details trailer
 * whose code disagrees with the call's status is ignored. */
export function fromServiceError(error: unknown): GenAIError {
  if (error instanceof GenAIError) return error;
  const e = error as Partial<ServiceError>;
  if (typeof e?.code !== "number") {
    return new GenAIError(Code.UNKNOWN, String((error as Error)?.message ?? error));
  }
  const metadata = e.metadata;
  const raw = metadata?.get("grpc-status-details-bin")[0];
  if (raw instanceof Uint8Array) {
    try {
      const st = Status.decode(raw);
      if (st.code === e.code) return errorFromStatus(st, metadata);
    } catch {
      // an undecodable trailer: fall back to the call's own status
    }
  }
  return errorFor(e.code, e.details ?? "", [], metadata);
}
