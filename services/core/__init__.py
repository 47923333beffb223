"""The shared core: wire schema, config, the gRPC runtime, telemetry, metrics, watchdog, retry, files."""
