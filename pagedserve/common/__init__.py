"""The floor every service and entry point stands on: wire types, config, logging, gRPC plumbing, text."""
