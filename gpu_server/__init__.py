"""The phos GPU server, in three rooms: control/ (the front end and the control plane), worker/
(a context's process) and backends/ (the devices). What all three share lives here: the address
space of contexts (address_space.py), the device memory ledger (device_ledger.py) and the keys
of admitted clients (client_keys.py)."""
