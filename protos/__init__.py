"""Protocol buffers of the public and internal gRPC APIs (generated code committed; see generate.sh)."""
