"""The server's control plane: the front end that hands out contexts and keeps the pool of
workers (frontend.py, cpu_share.py), the admin APIs (admin.py, admin_net.py, client_keys.py),
live handoff (handoff*.py) and recovery (recovery.py)."""
