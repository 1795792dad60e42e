"""Server reflection, v1 and v1alpha, for both planes' servers (shared with ``genai-kvstore``).

grpcio-reflection serves only ``grpc.reflection.v1alpha.ServerReflection``;
newer clients (grpcurl, Postman, buf curl) ask for ``grpc.reflection.v1``
first. The two versions' messages are the same on the wire (same fields and
numbers; only the package differs), so v1 is served by the same servicer
under the v1 name. The v1 service's own descriptor is the v1alpha file's,
renamed, so that v1 clients can describe it too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add the v1 reflection file to ``pool`` (once), derived from the v1alpha one."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names``
    and the two reflection services themselves."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    _register_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer(names)
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),)
    )
