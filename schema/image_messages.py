"""The image format's messages (schema/image.capnp), loaded once: snapshot/image.py writes
and reads them, and checks what the schema cannot say."""
import os

import capnp

capnp.remove_import_hook()
image_capnp = capnp.load(os.path.join(os.path.dirname(__file__), "image.capnp"))

Manifest = image_capnp.Manifest
ImageDelta = image_capnp.ImageDelta
MANIFEST_FORMAT = image_capnp.manifestFormat
MANIFEST_VERSION = image_capnp.manifestVersion
DELTA_FORMAT = image_capnp.deltaFormat
# the ids of the schema's annotations (what they mean: image.capnp)
ANNOTATIONS = {n.name: n.id for n in image_capnp.schema.node.nestedNodes if n.name in ("optional", "pair", "keys")}
