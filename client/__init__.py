"""The Python client of the public ``eagle3.v1.Generation`` API."""

from client.eagle3_client import TREE_KINDS, ClientError, Completion, Eagle3Client, StreamEvent

__all__ = ["ClientError", "Completion", "Eagle3Client", "StreamEvent", "TREE_KINDS"]
