"""What every service shares: the gRPC runtime, config, the wire schema, the CLI."""
