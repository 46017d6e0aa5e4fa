"""Fixtures and helpers shared by test modules."""
