package genai

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FieldViolation is one bad field of a request, as the server's
// google.rpc.BadRequest names it: its path (e.g. "sampling.temperature";
// empty when the server named none) and what is wrong with it.
type FieldViolation struct {
	Field       string
	Description string
}

// Error is a call that failed with a gRPC status other than OK: its code,
// the server's message and, for INVALID_ARGUMENT, the field violations of the
// google.rpc.BadRequest the server sends in the grpc-status-details-bin
// trailer (docs/design.md, "Status codes").
//
// Every error this package returns for a failed RPC is an *Error. Match it
// by code with errors.Is and the sentinels below
// (errors.Is(err, genai.ErrNotFound)), or get its fields with errors.As.
// A cancelled call also matches context.Canceled, and a call past its
// deadline context.DeadlineExceeded.
type Error struct {
	Code            codes.Code
	Message         string
	FieldViolations []FieldViolation
}

// Sentinels, one per status code the server uses; errors.Is compares codes.
var (
	ErrInvalidArgument    = &Error{Code: codes.InvalidArgument}
	ErrNotFound           = &Error{Code: codes.NotFound}
	ErrFailedPrecondition = &Error{Code: codes.FailedPrecondition}
	ErrResourceExhausted  = &Error{Code: codes.ResourceExhausted}
	ErrUnavailable        = &Error{Code: codes.Unavailable}
	ErrDeadlineExceeded   = &Error{Code: codes.DeadlineExceeded}
	ErrCanceled           = &Error{Code: codes.Canceled}
	ErrUnauthenticated    = &Error{Code: codes.Unauthenticated}
	ErrPermissionDenied   = &Error{Code: codes.PermissionDenied}
	ErrInternal           = &Error{Code: codes.Internal}
)

func (e *Error) Error() string {
	if e.Message == "" {
		return e.Code.String()
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// Is reports whether target is an *Error with the same code (such as one of
// the sentinels), or the context error matching a Canceled or
// DeadlineExceeded code.
func (e *Error) Is(target error) bool {
	switch target {
	case context.Canceled:
		return e.Code == codes.Canceled
	case context.DeadlineExceeded:
		return e.Code == codes.DeadlineExceeded
	}
	t, ok := target.(*Error)
	return ok && t.Code == e.Code
}

// GRPCStatus makes status.Code and status.FromError work on an *Error.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// Field is the violation naming field, if the server sent one.
func (e *Error) Field(field string) (FieldViolation, bool) {
	for _, v := range e.FieldViolations {
		if v.Field == field {
			return v, true
		}
	}
	return FieldViolation{}, false
}

// Code is the gRPC status code of err: codes.OK for nil, codes.Unknown for
// an error that carries no status.
func Code(err error) codes.Code {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return status.Code(err)
}

// fromStatus builds the *Error of a status, reading its BadRequest details.
func fromStatus(s *status.Status) *Error {
	e := &Error{Code: s.Code(), Message: s.Message()}
	for _, d := range s.Details() {
		if bad, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range bad.GetFieldViolations() {
				e.FieldViolations = append(e.FieldViolations, FieldViolation{v.GetField(), v.GetDescription()})
			}
		}
	}
	return e
}

// fromProtoStatus is the *Error of a google.rpc.Status (a GenerateBidi
// request's error event).
func fromProtoStatus(s *spb.Status) *Error { return fromStatus(status.FromProto(s)) }

// wrap turns what a gRPC call returned into an *Error (nil stays nil).
func wrap(err error) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	if s, ok := status.FromError(err); ok {
		return fromStatus(s)
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fromStatus(status.FromContextError(err))
	}
	return &Error{Code: codes.Unknown, Message: err.Error()}
}
