"""Wire schemas: phos.capnp (data plane) and admin.proto (control plane)."""
