"""Device names a user may pass (``--device``), checked before anything loads."""

from __future__ import annotations

from common.errors import InvalidRequestError


def device_type(device: str) -> str:
    """"cuda" or "cpu" for a checked device name (``auto``: CUDA when torch sees a GPU)."""
    if device != "auto":
        return device.partition(":")[0]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, field: str = "device") -> None:
    """Refuse what this machine cannot run on: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` only,
    CUDA only where torch sees a GPU, N below the GPU count."""
    kind, colon, index = device.partition(":")
    if device == "auto" or device == "cpu":
        return
    if kind != "cuda" or (colon and not index.isdigit()):
        raise InvalidRequestError(field, f"must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch  # only here: a client-side check must not pay for it

    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise InvalidRequestError(field, f"{device!r} asked for, but CUDA is not available ({why})")
    if index and int(index) >= torch.cuda.device_count():
        raise InvalidRequestError(field, f"{device!r} asked for, but this machine has "
                                         f"{torch.cuda.device_count()} GPU(s)")
