"""A context worker, one process a context: its call loop and mailbox (loop.py, native_box.py), its
control by the front end and the worker's State (control.py), its process (main.py), its session
(session.py) and the driver calls it serves (calls.py)."""
