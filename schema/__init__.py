"""Wire schemas: phos.capnp (the data plane, and the control plane between a front end and its
workers) and admin.proto (the admin API)."""
