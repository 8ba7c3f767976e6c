"""Test harness: fault injectors and helpers shared by the integration tests."""
