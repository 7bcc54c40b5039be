"""What the draft accepts from the verify service's handshake, checked before anything is mapped
or allocated: the handshake comes from another process, so a size in it is a request to allocate.

Every size must lie within ``LIMITS``; every buffer must be present once, with the shape and
dtype the other fields and the draft head imply; the allocations they imply (the draft's KV
cache and RoPE tables) are checked against free memory in ``EagleDrafter``.
"""

from __future__ import annotations

import json

from common.config import ModelConfig
from common.errors import EagleError, LinkProtocolError
from draft_service.eagle_config import DraftConfig
from link.convert import descriptor_from_proto
from link.shared_buffers import SHM, BufferDescriptor
from protos.eagle3.v1 import draft_link_pb2 as pb

# Sanity bounds far above any real deployment (a step of 64 sequences, 60-node trees, 128K context).
LIMITS = {"max_trees": 1 << 16, "max_tree_nodes": 1 << 16, "max_feature_rows": 1 << 24, "max_model_len": 1 << 24}
MAX_CHAIN_WIDTH = 1 << 10  # columns of chain_feeds: a count, then a tree's depth + 1 tokens
_FLOATS = ("float32", "float16", "bfloat16")


def checked_handshake(hello: pb.HandshakeResponse, head: DraftConfig) -> tuple[ModelConfig, dict[str, BufferDescriptor]]:
    """The target's config and the buffer descriptors, once every size and shape is as expected.

    Raises LinkProtocolError naming the first field that is not."""
    for name, cap in LIMITS.items():
        value = getattr(hello, name)
        if not 1 <= value <= cap:
            raise LinkProtocolError(f"handshake: {name} = {value} is outside [1, {cap}]")
    try:
        target = ModelConfig.from_hf(json.loads(hello.target_config_json))
    except (ValueError, TypeError, KeyError, EagleError) as exc:
        raise LinkProtocolError(f"handshake: the target's config does not parse: {str(exc)[:200]}") from exc
    try:
        descs = [descriptor_from_proto(b) for b in hello.buffers]
    except (KeyError, ValueError) as exc:
        raise LinkProtocolError(f"handshake: a buffer descriptor does not parse: {exc!r}"[:300]) from exc
    width = len(head.capture_layers(target)) * head.target_hidden_size
    trees = (hello.max_trees, hello.max_tree_nodes)
    expected = {"features": ((hello.max_feature_rows, width), _FLOATS),
                "embedding": ((head.vocab_size, head.target_hidden_size), _FLOATS),
                "tree_tokens": (trees, ("int64",)), "tree_parents": (trees, ("int64",)),
                "tree_log_probs": (trees, ("float32",)), "chain_trees": ((4, *trees), ("int64",))}
    by_name = {}
    for d in descs:
        if d.name == "chain_feeds" and len(d.shape) == 2 and 2 <= d.shape[1] <= MAX_CHAIN_WIDTH:
            expected["chain_feeds"] = ((hello.max_trees, d.shape[1]), ("int64",))  # its width: the verify side's depth
        if d.name not in expected or d.name in by_name:
            raise LinkProtocolError(f"handshake: unexpected or repeated buffer {d.name[:64]!r}")
        if d.name.startswith("tree_") and d.backend != SHM:  # written and read on the host by both sides
            raise LinkProtocolError(f"handshake: buffer {d.name!r} is {d.backend} memory, expected shared host memory")
        shape, dtypes = expected[d.name]
        if d.shape != shape or d.dtype not in dtypes:
            raise LinkProtocolError(f"handshake: buffer {d.name!r} is {d.dtype} {list(d.shape)[:8]}, "
                                    f"expected {' or '.join(dtypes)} {list(shape)}")
        by_name[d.name] = d
    missing = sorted(set(expected) - set(by_name) | ({"chain_feeds"} - set(by_name)))
    if missing:
        raise LinkProtocolError(f"handshake: buffers missing: {', '.join(missing)}")
    return target, by_name
