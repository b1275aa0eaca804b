"""A context worker, one process a context: its loop and mailbox (loop.py, native_box.py), its
session (session.py) and the driver calls it serves (calls.py)."""
