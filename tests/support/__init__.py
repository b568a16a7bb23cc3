"""Helpers shared by test modules (imported, never collected)."""
