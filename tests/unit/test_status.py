"""genai_common.status: a domain error as a google.rpc.Status."""

from __future__ import annotations

from google.rpc import error_details_pb2

from genai_common.errors import Internal, InvalidArgument
from genai_common.status import MAX_MESSAGE_CHARS, rpc_status_of


def test_a_bad_argument_names_its_field() -> None:
    status = rpc_status_of(InvalidArgument("sampling.top_p: 2.0 is out of range"))
    assert status.code == 3 and status.message == "sampling.top_p: 2.0 is out of range"
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("sampling.top_p", "2.0 is out of range")
    ]


def test_long_messages_are_cut_so_the_trailers_stay_small() -> None:
    # grpc-message, Status.message and the BadRequest description all carry it;
    # clients refuse more than 16 KiB of metadata.
    status = rpc_status_of(InvalidArgument("constraint.regex: " + "x" * 10_000))
    assert len(status.message) == MAX_MESSAGE_CHARS and status.message.endswith("\u2026")
    assert status.ByteSize() < 5_000
    assert len(rpc_status_of(Internal("y" * 10_000)).message) == MAX_MESSAGE_CHARS
