#!/usr/bin/env bash
# Regenerates the committed Python stubs from the .proto files. Run with grpcio-tools 1.84
# (`pip install grpcio-tools==1.84.0`): stubs from a newer generator refuse older grpcio
# runtimes, and the GPU hosts run grpcio 1.84.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/eagle3/v1/*.proto
