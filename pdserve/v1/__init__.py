"""Generated gRPC stubs (proto/generate.py); never edit by hand.

convert.py, beside them, is hand-written: protobuf <-> pdserve dataclasses."""
