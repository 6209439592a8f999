"""Span and metric builders, and the private OpenTelemetry providers."""
