"""Snapshots of contexts: engine, image format and stores.

Submodules: `fingerprint` (the pfp1 chunk fingerprint), `image` (format, writer,
verified reader, deletion) and `store` (DirStore, MemoryStore).
"""
from .image import (ImageError, ImageWriter, Manifest, delete_image, gc, latest_image, read_chunk, read_image,
                    read_region, validate_manifest)
from .store import DirStore, MemoryStore

__all__ = ["ImageError", "ImageWriter", "Manifest", "delete_image", "gc", "latest_image", "read_chunk", "read_image",
           "read_region", "validate_manifest", "DirStore", "MemoryStore"]
