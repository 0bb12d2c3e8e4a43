"""The worker process: gRPC servicer for the prefill/decode/both roles around one engine-loop thread."""
