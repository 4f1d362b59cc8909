"""Generated gRPC stubs (proto/generate.py); never edit by hand."""
