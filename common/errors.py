"""Typed errors shared by every part of the server.

Each class maps to exactly one gRPC status code (``grpc_code``), so the service
layer translates errors with one table and never turns a request error into
INTERNAL. Programmer invariants use ``assert`` instead.
"""


class EagleError(Exception):
    """Base class of every error the project raises on purpose."""

    grpc_code = "INTERNAL"


class InvalidRequestError(EagleError, ValueError):
    """A request (prompt, sampling parameters, limits) is malformed.

    ``field`` names the offending request field, for rich error details.
    """

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelNotFoundError(EagleError, FileNotFoundError):
    """A model or checkpoint directory, or a file it must contain, does not exist."""

    grpc_code = "NOT_FOUND"


class CheckpointError(EagleError):
    """A checkpoint exists but cannot be used: corrupted, truncated, wrong shapes or names."""

    grpc_code = "FAILED_PRECONDITION"


class UnsupportedModelError(EagleError):
    """A config asks for an architecture or feature the runtime does not implement."""

    grpc_code = "FAILED_PRECONDITION"


class ConversionError(EagleError):
    """The embedded default model could not be obtained or converted."""

    grpc_code = "FAILED_PRECONDITION"


class CapacityError(EagleError):
    """The KV cache (or another bounded resource) cannot hold what was asked for."""

    grpc_code = "RESOURCE_EXHAUSTED"


class SharedBufferError(EagleError):
    """A buffer shared between the services cannot be exported or mapped: peers on different
    hosts or GPUs, mismatched backends, a vanished (restarted) exporter, or cupy missing."""

    grpc_code = "FAILED_PRECONDITION"


class LinkProtocolError(EagleError):
    """The peer on the internal draft link broke its protocol: sizes or shapes outside what the
    link allows, buffers that do not match their description, messages nobody asked for, or a
    second draft while one is connected."""

    grpc_code = "FAILED_PRECONDITION"


class ShuttingDownError(EagleError):
    """The service is shutting down: it finishes the requests in flight and takes no new ones."""

    grpc_code = "UNAVAILABLE"


class UnsafeSocketFolderError(EagleError):
    """A unix socket's folder that another user could write to or owns: refused, never trusted."""

    grpc_code = "FAILED_PRECONDITION"


class AddressInUseError(EagleError):
    """A service cannot listen where it was told to: the address is taken or not available."""

    grpc_code = "UNAVAILABLE"


class MissingExtraError(EagleError):
    """An optional feature was asked for, but the extra that provides it is not installed."""

    grpc_code = "FAILED_PRECONDITION"
