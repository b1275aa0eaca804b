"""Wire schemas: phos.capnp (the data plane, and the control plane between a front end and its
workers), admin.proto (the admin API) and image.capnp (the image format: manifests and deltas)."""
