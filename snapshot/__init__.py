"""Snapshots of contexts: engine, image format and stores.

Submodules: `fingerprint` (the pfp1 chunk fingerprint), `image` (format, writer,
verified reader, deletion), `store` (DirStore, MemoryStore) and `host_store` (HostStore, in
shared host memory; open_store picks the kind a path holds).
"""
from .image import (ImageError, ImageWriter, Manifest, delete_image, gc, latest_image, read_chunk, read_image,
                    read_latest_image, read_region, validate_manifest)
from .host_store import HostStore, open_store
from .store import DirStore, MemoryStore

__all__ = ["ImageError", "ImageWriter", "Manifest", "delete_image", "gc", "latest_image", "read_chunk", "read_image",
           "read_latest_image", "read_region", "validate_manifest", "DirStore", "HostStore", "MemoryStore", "open_store"]
