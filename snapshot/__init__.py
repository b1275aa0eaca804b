"""Snapshots of contexts: engine, image format and stores."""
