"""Projector service: folds every event into ClickHouse and answers read-only queries."""
